"""Decoding: proposal, acceptance, back-off and the generation loop."""
