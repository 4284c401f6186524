"""scripts/profile_step.py's own parts: the tables it hands benchmark_tables.py, and the
llama.cpp timings it attaches (read, or refused in one line)."""

from __future__ import annotations

import json

import pytest

from .test_scripts import SCRIPTS, load_script

profile_step = load_script(SCRIPTS / "profile_step.py")
tables_script = load_script(SCRIPTS / "benchmark_tables.py")


def _cell(mode, threads, kernel):
    return {"mode": mode, "threads": threads, "wall_us": 100.0, "measured_us": 90.0, "ops_us": kernel, "tokens_per_forward": 1.0,
            "parts_us": {"linear kernels: q4_1": kernel, "Python and dispatch elsewhere": 100.0 - kernel},
            "kernels_by_linear_us": {"q_proj": {"q4_1": kernel}}, "top_level_ops_per_step": 10.0, "ops_per_step": 20.0,
            "allocating_ops_per_step": 5.0, "allocated_kb_per_step": 1.5}


def test_the_tables_render_as_the_docs_pages_do(tmp_path):
    record = {"machine": {"cpu": "AMD EPYC", "cores": 2, "cpu_flags": ["avx2", "fma"]}, "command": "python scripts/profile_step.py",
              "load_before": [0.1], "load_after": [0.2], "settings": {"max_new_tokens": 8}}
    cells = [_cell("ar", 1, 40.0), _cell("ar", 2, 25.0)]
    lcpp = {"source": "llama-bench", "ops": {"MUL_MAT": 900.0}}
    made = profile_step.tables(record, cells, lcpp, "profile_step.json")
    (tmp_path / "profile.json").write_text(json.dumps({"tables": made}))
    tables = tables_script.load_tables(tmp_path)  # the docs' own checks: fields, widths, one id each
    assert set(tables) == {"profile-step", "profile-kernels", "profile-llama-cpp"}
    step = tables["profile-step"]
    assert step["columns"] == ["part (us per step)", "ar, 1 thread", "ar, 2 threads"]
    assert ["linear kernels: q4_1", 40.0, 25.0] in step["rows"]
    assert ["unprofiled step (best run)", 90.0, 90.0] in step["rows"]
    assert ["unprofiled step less the profiled ops (Python, dispatch)", 50.0, 65.0] in step["rows"]
    assert tables["profile-kernels"]["rows"] == [["q_proj (q4_1)", 40.0, 25.0]]
    assert tables["profile-llama-cpp"]["rows"] == [["MUL_MAT", 900.0]] and "AMD EPYC" in step["machine"]
    assert "| linear kernels: q4_1 | 40.0 | 25.0 |" in tables_script.render(step)


def test_llama_cpp_timings_are_read_or_refused_in_one_line(tmp_path):
    assert profile_step.llama_cpp(None) is None
    good = tmp_path / "ops.json"
    good.write_text(json.dumps({"source": "x", "ops": {"MUL_MAT": 1.5}}))
    assert profile_step.llama_cpp(str(good))["ops"] == {"MUL_MAT": 1.5}
    for text, words in (("not json", "cannot read it as JSON"), (json.dumps({"ops": {"a": "slow"}}), "microseconds per token"),
                        (json.dumps([1]), "microseconds per token")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(SystemExit, match=words) as err:
            profile_step.llama_cpp(str(bad))
        assert "\n" not in str(err.value)
