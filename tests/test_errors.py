"""Bad input gets a clear error naming the culprit and the fix, and leaves nothing half-done."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from deepcompile import Config, ConfigError
from tests.dist_utils import run_ranks


def test_unknown_key_names_its_path_and_a_suggestion():
    with pytest.raises(ConfigError, match=r"config\.mixed_precision\.param_dtyp: unknown key; did you mean 'config\.mixed_precision\.param_dtype'"):
        Config.load({"mixed_precision": {"param_dtyp": "bfloat16"}})
    with pytest.raises(ConfigError, match=r"config\.zero_stag\b"):
        Config.load({"zero_stag": 3})


def test_bad_values_name_the_value_and_the_choices():
    with pytest.raises(ConfigError, match=r"config\.zero_stage: 5 is not one of \[1, 2, 3\]"):
        Config.load({"zero_stage": 5})
    with pytest.raises(ConfigError, match=r"config\.compiler: 'tensorrt' is not one of"):
        Config.load({"compiler": "tensorrt"})
    with pytest.raises(ConfigError, match=r"config\.gradient_accumulation_steps: 0 is below the minimum 1"):
        Config.load({"gradient_accumulation_steps": 0})
    with pytest.raises(ConfigError, match=r"config\.passes\[0\]\.name: unknown pass 'zer03'"):
        Config.load({"passes": ["zer03"]})
    with pytest.raises(ConfigError, match=r"expected an integer, got '3'"):
        Config.load({"zero_stage": "3"})


def test_config_from_json_file(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{"compiler": "aot_eager", "mixed_precision": {"param_dtype": "bfloat16"}}')
    c = Config.load(str(p))
    assert c.compiler == "aot_eager" and c.mixed_precision.param_dtype == "bfloat16"
    p.write_text('{"compiler": ')
    with pytest.raises(ConfigError, match="not valid JSON"):
        Config.load(str(p))
    with pytest.raises(ConfigError, match="does not exist"):
        Config.load(str(tmp_path / "nope.json"))


def test_no_process_group_and_no_launcher():
    code = ("import torch, deepcompile\n"
            "from deepcompile.models import GPT\n"
            "m = GPT()\n"
            "try:\n"
            "    deepcompile.initialize(m, lambda ps: torch.optim.SGD(ps, lr=0.1), {})\n"
            "except RuntimeError as e:\n"
            "    print('ERR', e)\n"
            "from torch.nn.utils import parametrize\n"
            "print('UNTOUCHED', not any(parametrize.is_parametrized(x) for x in m.modules()))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert "ERR deepcompile.initialize: no torch.distributed process group" in out.stdout, out.stdout + out.stderr
    assert "torchrun" in out.stdout
    assert "UNTOUCHED True" in out.stdout


def _already_compiled(rank, world):
    import deepcompile
    from deepcompile.models import GPT

    m = torch.compile(GPT())
    try:
        deepcompile.initialize(m, lambda ps: torch.optim.SGD(ps, lr=0.1), {})
    except TypeError as e:
        return str(e)
    return "no error"


def test_already_compiled_model():
    (msg,) = run_ranks(_already_compiled, 1, timeout=300)
    assert "already compiled" in msg and "_orig_mod" in msg


def _shards_differ(rank, world):
    import deepcompile
    from deepcompile.models import GPT, GPTConfig
    from deepcompile.runtime import ops
    from torch.nn.utils import parametrize

    m = GPT(GPTConfig(n_embd=32 if rank == 0 else 48))  # a rank built a different model
    try:
        deepcompile.initialize(m, lambda ps: torch.optim.SGD(ps, lr=0.1), {})
    except ValueError as e:
        untouched = not any(parametrize.is_parametrized(x) for x in m.modules())
        return str(e), untouched, bool(ops.C.is_initialized())
    return "no error", None, None


def test_shards_that_differ_across_ranks():
    results = run_ranks(_shards_differ, 2, timeout=300)
    for msg, untouched, runtime_alive in results:
        assert "differs across ranks" in msg and "pos_emb" in msg, msg
        assert "rank 0 has" in msg and "rank 1 has" in msg
        assert untouched, "the model was modified although initialize failed"
        assert not runtime_alive, "the runtime stayed initialized although initialize failed"


def test_default_plan_compiles_with_inductor_once():
    """The default ZeRO-3 plan warms up under aot_eager and switches to Inductor with the final
    pass list; an explicit choice (or an explicit pass list) is left alone."""
    from deepcompile.config import Config

    c = Config.load({})
    assert [c.compiler_at(s) for s in range(4)] == ["aot_eager", "aot_eager", "inductor", "inductor"]
    assert [e.name for e in c.passes_at(2)] == ["zero3", "prefetch", "selective_unshard"]
    c = Config.load({"warmup_compiler": "inductor"})
    assert {c.compiler_at(s) for s in range(4)} == {"inductor"}
    c = Config.load({"passes": ["zero3"]})
    assert c.schedule == [] and c.profile_step is None and c.compiler_at(0) == "inductor"
