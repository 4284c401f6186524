"""``evaluate`` on a tiny random Llama: each metric against an independent hand computation."""

import io
import json
import math
import sys

import pytest
import torch
from .eval_reference import target_logprobs, topk_hits

from multitoken.base.data import DataConfig
from multitoken.pipeline.eval.evaluate import EvalConfig, HeadAccumulator, evaluate
from multitoken.pipeline.eval.headscores import score_head
from multitoken.pipeline.eval.lens import lens_kl_sums
from multitoken.pipeline.eval.marginal import marginal_second_token
from multitoken.pipeline.model.model import MultiTokenModel


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(1))


def test_accumulator_matches_hand_computation(tiny_model, ids):
    logps = tiny_model.head_logits(ids, last_only=False)  # 3 x [B, T, V]
    feats = tiny_model.features(ids)
    acc = HeadAccumulator(3)
    for i in range(3):
        acc.add_head(i, score_head(tiny_model, i, feats, ids, chunk=7))  # chunks cut across sequences
    acc.end_batch()
    rep = acc.report()
    # PPL_1 is the base model's ordinary perplexity: transformers' own shifted LM loss.
    hf_loss = tiny_model.backbone.causal_lm(input_ids=ids, labels=ids).loss
    assert rep["heads"][0]["ppl"] == pytest.approx(math.exp(float(hf_loss)), rel=1e-4)
    # Head 2 and PPL_1:2 by explicit loops over (sequence, position).
    nll2, joint, hits2, chain = [], [], 0, 0
    for b in range(2):
        for t in range(16 - 2):
            a = -float(logps[0][b, t, ids[b, t + 1]])
            c = -float(logps[1][b, t, ids[b, t + 2]])
            nll2.append(c)
            joint.append(a + c)
            hits2 += int(logps[1][b, t].argmax() == ids[b, t + 2])
        for t in range(16 - 3):  # the chain counts positions where all 3 targets exist
            chain += int(logps[1][b, t].argmax() == ids[b, t + 2] and logps[2][b, t].argmax() == ids[b, t + 3])
    assert rep["heads"][1]["ppl"] == pytest.approx(math.exp(sum(nll2) / len(nll2)), rel=1e-5)
    assert rep["heads"][1]["top1"] == hits2 / len(nll2)
    assert rep["ppl_joint"]["PPL_1:2"] == pytest.approx(math.exp(sum(joint) / (2 * len(joint))), rel=1e-5)
    acc2, acc3 = rep["heads"][1]["top1"], rep["heads"][2]["top1"]
    assert rep["accept_length"]["formula_with_base_token"] == pytest.approx(1 + acc2 + acc2 * acc3)
    assert rep["accept_length"]["empirical_without_base_token"] == pytest.approx(
        sum(logps[1][b, t].argmax() == ids[b, t + 2] for b in range(2) for t in range(13)).item() / 26 + chain / 26)
    # tree shapes: head 2's accuracy per rank of its guesses, by the same loop
    from multitoken.decoding.trees import MAX_RANKS

    ranks = torch.zeros(MAX_RANKS)
    for b in range(2):
        for t in range(16 - 2):
            order = logps[1][b, t].argsort(descending=True)[:MAX_RANKS]
            ranks += (order == ids[b, t + 2]).float()
    tree = rep["tree"]["rank_accuracy"]
    assert len(tree) == 2 and tree[0] == pytest.approx((ranks / 28).tolist()) and tree[0][0] == rep["heads"][1]["top1"]


def test_marginal_matches_one_pass_per_candidate(tiny_model, ids):
    bb = tiny_model.backbone
    seq, pos = ids[0], torch.tensor([2, 7])
    out = marginal_second_token(bb, seq, pos, top_p=0.9, max_candidates=4, chunk=3)
    base = torch.log_softmax(bb.logits(bb.decoder(input_ids=seq[None]).last_hidden_state[0]).float(), -1)
    for r, t in enumerate(pos.tolist()):
        p1 = base[t].exp()
        ys = p1.argsort(descending=True)[: int(out.nucleus_size[r])]
        q = sum(p1[y] * torch.softmax(bb.logits(bb.decoder(input_ids=torch.cat([seq[: t + 1], y[None]])[None])
                                                .last_hidden_state[0, -1]).float(), -1) for y in ys)
        assert torch.allclose(out.logq[r], (q / p1[ys].sum()).log(), atol=1e-4)
        assert float(out.nucleus_mass[r]) == pytest.approx(float(p1[ys].sum()), rel=1e-5)


def test_logit_lens_kl(tiny_model, ids):
    bb = tiny_model.backbone
    sums = lens_kl_sums(bb, ids[:1], chunk=5)
    assert sums.shape == (bb.num_layers + 1,) and float(sums[-1]) == pytest.approx(0.0, abs=1e-6)
    states = bb.hidden_states(ids[:1])
    final = torch.log_softmax(bb.logits(states[-1][0]).float(), -1)
    mid = torch.log_softmax(bb.logits(bb.final_norm(states[1][0])).float(), -1)
    hand = float((mid.exp() * (mid - final)).sum())
    assert float(sums[1]) == pytest.approx(hand, rel=1e-4)


def test_evaluate_end_to_end(tiny_model, tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text("Once upon a time there was a little girl who liked to play in the park with her dog. " * 20)
    cfg = EvalConfig(seq_len=32, batch_size=2, marginal_every=40, max_candidates=8, lens_tokens=64)
    rep = evaluate(tiny_model, cfg, DataConfig(data=str(text), max_tokens=300))
    assert rep["tokens"] == rep["sequences"] * 32 and rep["sequences"] == 9
    assert set(rep["seconds"]) == {"ppl", "dynamic", "marginal", "lens"}
    assert [d["eps_b"] for d in rep["dynamic"]] == [0.0, 0.25, 0.5, 0.75, 1.0] and rep["dynamic"][-1]["tokens_per_step"] == 1.0
    assert rep["heads"][0]["count"] == 9 * 31 and rep["heads"][2]["count"] == 9 * 29
    assert rep["marginal"]["positions"] == len(range(0, 9 * 32, 40))
    assert len(rep["logit_lens"]["kl_per_layer"]) == tiny_model.backbone.num_layers + 1
    assert rep["logit_lens"]["tokens"] == 64
    assert rep["speedup_theory"]["g"] == 2 and rep["speedup_theory"]["tokens_per_step"] == pytest.approx(
        rep["accept_length"]["empirical_with_base_token"])
    json.dumps(rep)  # JSON-ready


def test_cli_eval_writes_report_plot_and_config(tiny_model, tmp_path, capsys):
    from multitoken.pipeline.cli import main

    heads = tiny_model.save_heads(tmp_path / "heads")
    text = tmp_path / "doc.txt"
    text.write_text("The cat sat on the mat and the dog ran to the park. " * 30)
    out = tmp_path / "eval"
    code = main(["eval", "--heads", str(heads), "--data", str(text), "--max-tokens", "200", "--seq-len", "32",
                 "--marginal-every", "50", "--max-candidates", "4", "--lens-tokens", "32", "--out", str(out)])
    assert code == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["heads_dir"] == str(heads) and rep["head_type"] == "replicated" and len(rep["heads"]) == 3
    assert (out / "logit_lens.png").stat().st_size > 1000
    assert json.loads((out / "eval_config.json").read_text())["command"] == "eval"
    printed = capsys.readouterr().out
    assert "PPL_1:n" in printed and "marginalization baseline" in printed
    assert json.loads((out / "eval_config.json").read_text())["data_files"] == [str(text)]
    # the per-rank accuracies go to --out and beside the heads, where generate --tree static reads them
    tree = json.loads((out / "rank_accuracy.json").read_text())
    assert json.loads((heads / "rank_accuracy.json").read_text()) == tree == rep["tree"]
    from multitoken.decoding.trees import read_accuracies

    assert read_accuracies(heads, 2).table == tree["rank_accuracy"] and len(tree["rank_accuracy"][0]) == 32
    assert "tree accuracies:" in printed
    assert main(["eval", "--heads", str(heads), "--data", str(text), "--out", str(out), "--parts", "bogus"]) == 2


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("quiet", [False, True])
def test_eval_progress_bars_go_to_a_terminal_stderr_only(tiny_model, tmp_path, monkeypatch, capsys, quiet):
    text = tmp_path / "doc.txt"
    text.write_text("The cat sat on the mat and the dog ran to the park. " * 30)
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    cfg = EvalConfig(seq_len=32, batch_size=2, parts=("ppl", "lens"), lens_tokens=32, quiet=quiet)
    evaluate(tiny_model, cfg, DataConfig(data=str(text), max_tokens=128))
    shown = term.getvalue()
    if quiet:
        assert shown == ""
    else:  # one bar per part, at its final count
        assert "eval ppl" in shown and "128/128" in shown and "eval lens" in shown and "32.0/32.0" in shown
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no bars either
    evaluate(tiny_model, EvalConfig(seq_len=32, batch_size=2, parts=("ppl",)), DataConfig(data=str(text), max_tokens=64))
    assert sys.stderr.getvalue() == ""


@pytest.mark.parametrize("head_type", ["replicated", "cp"])
def test_score_head_matches_full_log_probs(tiny_model, ids, head_type):
    model = tiny_model if head_type == "replicated" else MultiTokenModel.attach(
        tiny_model.backbone, {"head_type": "cp", "n_future": 2, "rank": 2})
    feats = model.features(ids)
    for i in range(model.n_future):
        full = model.heads.log_probs(i, feats)  # [B, T, V]
        sc = score_head(model, i, feats, ids, k=4, chunk=5)
        assert torch.allclose(sc.lp, target_logprobs(full, ids, i + 1), atol=1e-5)
        assert torch.equal(sc.top5, topk_hits(full, ids, i + 1)[5])
        assert torch.allclose(sc.top_vals, full.topk(4, dim=-1).values, atol=1e-5)
