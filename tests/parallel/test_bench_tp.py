"""`kvstate bench tp --quick`: both sides run, the greedy tokens agree, ratios and shares are reported."""

import json

from kvstate.cli import main


def test_bench_tp_quick_json(capsys):
    assert main(["bench", "tp", "--quick", "--json", "--new-tokens", "3", "--prefill-len", "16", "--batch", "2"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["same_tokens"] is True and row["tp"] == 2
    assert row["tp1"]["decode_tok_s"] > 0 and row["tp2"]["prefill_tok_s"] > 0
    assert row["decode_ratio"] > 0 and 0 < row["tp2"]["all_reduce_share"] < 1
