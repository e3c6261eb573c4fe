"""benchmarks/harness/megatron_lm_configs.py on a made-up checkout: inference cases are skipped,
each flag use is classified, and a path that is no checkout is one error line."""

import json
import os

import pytest

from benchmarks.harness.megatron_lm_configs import main

TRAIN = """MODEL_ARGS:
  --num-layers: 2
  --use-mcore-models: true
  --no-load-rng: false
  --micro-batch-size: 4
  --log-progress: true
  --moe-router-topk: 2
  --not-a-flag-anywhere: 3
"""
INFER = """MODEL_ARGS:
  --num-layers: 2
  --prompts: "hello"
"""


def test_counts_training_configs_by_status(tmp_path, capsys):
    for name, text in (("train_case", TRAIN), ("infer_case", INFER)):
        d = tmp_path / "tests" / "functional_tests" / "test_cases" / "gpt" / name
        os.makedirs(d)
        (d / "model_config.yaml").write_text(text)
    main(["--megatron-lm", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert out["configs"] == 2 and out["training_configs"] == 1
    # --no-load-rng false is left out; mbs 4 is honoured (4 x --seq-length tokens a packed
    # micro-batch), MoE is refused, the logging extra is ignored
    assert out["counts"] == {"honoured": 3, "unsupported": 1, "ignored": 1, "unrecognized": 1}
    assert out["honoured_fraction"] == round(3 / 6, 4) and out["unrecognized"] == [["--not-a-flag-anywhere", 1]]
    assert [r[0].split(":")[0] for r in out["top_refused"]] == ["--moe-router-topk"]


def test_not_a_checkout_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--megatron-lm", str(tmp_path)])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(err) == 1 and "no tests/functional_tests there" in err[0], err
