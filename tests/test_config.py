"""jscenegen/config.py: YAML errors in one line with file, line and column; errors blame the
override that set a bad value, not the config file."""
import argparse
import re

import pytest

from jscenegen.commands import seed_arg
from jscenegen.config import SEED_MAX, ConfigError, load_config, read_yaml
from jscenegen.run_config import RunConfig


def test_malformed_yaml_is_one_line_with_file_line_and_column(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("optim:\n  lr: 1.0e-5\nschedule:\n  roles: [D, P\n  group_size: 8\n")
    with pytest.raises(ConfigError) as info:
        read_yaml(f)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"{f}:5:13: not valid YAML: expected ',' or ']', but got ':'")
    assert "line 4, column 10" in msg  # where the unclosed sequence starts
    f.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping of sections, got list"):
        load_config(f, [], RunConfig)
    f.write_text("optim:\n  lr: 1.0e-5\n  lr: 1.0e-3\n")  # PyYAML alone keeps the last
    with pytest.raises(ConfigError, match=f"^{f}:3:3: not valid YAML: duplicate key 'lr'$"):
        read_yaml(f)
    f.write_text("# nothing but a comment\n")
    with pytest.raises(ConfigError, match="empty config file"):
        load_config(f, [], RunConfig)
    with pytest.raises(ConfigError, match=f"config file {tmp_path}: is a directory"):
        read_yaml(tmp_path)
    with pytest.raises(ConfigError, match="schedule.group_size"):
        load_config(None, ["schedule.group_size=1"], RunConfig)


def test_errors_blame_the_override_that_set_the_value(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("optim:\n  lr: 1.0e-5\nschedule:\n  group_size: two\n")
    with pytest.raises(ConfigError) as info:
        load_config(f, ["optim.lr=fast", "sampling.buckets=[64,x]", "optim.learning_rate=1"], RunConfig)
    lines = str(info.value).splitlines()
    assert any(line.startswith("override optim.lr=fast: optim.lr: ") for line in lines)
    assert "override sampling.buckets=[64,x]: sampling.buckets: expected a number, not a string (got [64, \"x\"])" in lines
    assert "override optim.learning_rate=1: unknown key 'optim.learning_rate'" in lines
    assert any(line.startswith(f"{f}: schedule.group_size: ") for line in lines)  # the file's own
    with pytest.raises(ConfigError, match=r"^override judge.backend=http: judge.backend 'http' "
                                          r"needs judge.base_url"):
        load_config(None, ["judge.backend=http"], RunConfig)
    # a section-level check may read any override under it: those its message names are blamed
    # (all six judge overrides were, with "judge: judge.base_url ..." echoing the section)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["judge.backend=http", "judge.model=m", "judge.timeout_s=5",
                           "judge.base_url=127.0.0.1:8000/v1"], RunConfig)
    assert str(info.value).startswith("override judge.base_url=127.0.0.1:8000/v1: judge.base_url "
                                      "'127.0.0.1:8000/v1' is not an http(s) URL"), str(info.value)
    assert "(got" not in str(info.value)
    with pytest.raises(ConfigError, match=r"^overrides judge.backend=http, judge.base_url=: "
                                          r"judge.backend 'http' needs judge.base_url and "
                                          r"judge.model \(`judge.base_url=` reads as null\)$"):
        load_config(None, ["judge.backend=http", "judge.timeout_s=5", "judge.base_url="], RunConfig)
    with pytest.raises(ConfigError, match=r"^override judge.backend=http: judge.backend"):
        load_config(None, ["judge.backend=http", "judge.timeout_s=5"], RunConfig)
    # `key=` is YAML null: "(got None)" did not say where the None came from
    with pytest.raises(ConfigError, match=r"^override schedule.roles=: schedule.roles: Input should "
                                          r"be a valid string \(got no value: `key=` reads as null\)$"):
        load_config(None, ["schedule.roles="], RunConfig)


def test_an_empty_coordinator_address_is_refused_not_read_as_unset():
    """`mesh.coordinator_address=""` fell back to $JSCENEGEN_COORDINATOR silently."""
    with pytest.raises(ConfigError, match=r'^override mesh.coordinator_address="": '
                                          r"mesh.coordinator_address: String should have at least 1 "
                                          r'character \(got ""\)$'):
        load_config(None, ['mesh.coordinator_address=""'], RunConfig)


def test_a_boolean_is_not_a_number(tmp_path):
    """pydantic reads `true` as 1 for an int field; a config must say the number."""
    # as the user wrote it: no pydantic "Value error, " prefix, `true` not Python's `True`
    with pytest.raises(ConfigError, match=r"^override mesh.fsdp=true: mesh.fsdp: expected a number, "
                                          r"not a boolean \(got true\)$"):
        load_config(None, ["mesh.fsdp=true"], RunConfig)
    f = tmp_path / "run.yaml"
    f.write_text("optim:\n  lr: false\n")
    with pytest.raises(ConfigError, match=f"{f}: optim.lr: .*not a boolean"):
        load_config(f, [], RunConfig)
    for item in ("optim.betas=[false,0.999]", "sampling.buckets=[true,64]"):   # inside lists too
        with pytest.raises(ConfigError, match=f"override {re.escape(item)}: .*not a boolean"):
            load_config(None, [item], RunConfig)


def test_a_number_given_for_a_text_field_says_to_quote_it(tmp_path):
    """`logging.experiment=123` was refused as "Input should be a valid string" with no hint that
    YAML had read a number (taking it as text would keep YAML's rewrite: 007 is 7, 1.10 is 1.1)."""
    with pytest.raises(ConfigError, match=r"^override logging.experiment=123: logging.experiment: "
                                          r"Input should be a valid string \(got 123\); YAML read a "
                                          r"number there: quote the text to keep it as typed, "
                                          r"'logging.experiment=\"...\"'$"):
        load_config(None, ["logging.experiment=123"], RunConfig)
    assert load_config(None, ['logging.experiment="007"'], RunConfig).logging.experiment == "007"
    f = tmp_path / "run.yaml"
    f.write_text("logging:\n  experiment: 1.10\n")
    with pytest.raises(ConfigError, match=r"\(got 1.1\); YAML read a number there: quote the text "
                                          r"to keep it as typed, experiment: \"...\"$"):
        load_config(f, [], RunConfig)
    for text, kind in (("true", "a boolean"), ("2024-01-01", "a date")):
        with pytest.raises(ConfigError, match=rf"; YAML read {kind} there: quote the text to keep it as "
                                              r"typed, 'logging.experiment=\"...\"'$"):
            load_config(None, [f"logging.experiment={text}"], RunConfig)


def test_swanlab_names_are_checked_with_the_config():
    """A project name swanlab refuses (a space, a slash) or a 3,000-character experiment passed
    the config and failed in swanlab.init after the warm start and model load, blamed on
    logging.swanlab_mode (helper-82)."""
    with pytest.raises(ConfigError, match=r"^override logging.project=my proj: logging.project: "
                                          r"String should match pattern"):
        load_config(None, ["logging.project=my proj"], RunConfig)
    with pytest.raises(ConfigError, match=r"logging.experiment: String should have at most 512 "):
        load_config(None, ["logging.experiment=" + "a" * 513], RunConfig)
    cfg = load_config(None, ["logging.project=a.b-c+d_1", "logging.experiment=ü/x y"], RunConfig)
    assert (cfg.logging.project, cfg.logging.experiment) == ("a.b-c+d_1", "ü/x y")


def test_a_string_is_unicode_text():
    """Bytes that are not UTF-8 on a command line arrive as lone surrogates: no file or
    tokenizer can encode them, so they are refused where they are given."""
    with pytest.raises(ConfigError, match=r"scene.prompts_dir: .*character 2 is a lone surrogate"):
        load_config(None, ["scene.prompts_dir=ab\udcffc"], RunConfig)
    assert load_config(None, ["mesh.fsdp=3", "optim.lr=1"], RunConfig).optim.lr == 1.0
    assert load_config(None, ["sampling.greedy=true", "sampling.top_p=1.0"], RunConfig).sampling.greedy


def test_greedy_as_an_override_names_the_top_p_the_config_file_sets():
    """`sampling.greedy=true` under the CPU default (whose file sets top_p 0.9) was refused as
    "greedy sampling ignores top_k/top_p; leave them off", blaming a user who set neither;
    and `--greedy sampling.greedy=true` got that message instead of --greedy's "repeats" one.
    The rule: greedy needs top_k 0 and top_p 1.0; the refusal names the values, the file that
    set them, and the overrides to add."""
    from jscenegen.paths import resolve_data_path
    from jscenegen.run_config import DEFAULT_CONFIG, load_run_config

    with pytest.raises(ConfigError) as info:
        load_run_config(None, ["sampling.greedy=true"])
    assert str(info.value) == (
        "override sampling.greedy=true: sampling.greedy takes the argmax, so top_k and top_p must "
        "be off, but sampling.top_p is 0.9: set sampling.top_p=1.0 too (--greedy, on the commands "
        f"that have it, sets all three) ({resolve_data_path(DEFAULT_CONFIG)} sets sampling.top_p 0.9)")
    with pytest.raises(ConfigError, match=r"^--greedy sets .*the override sampling.greedy=true "
                                          r"contradicts or repeats it"):
        load_run_config(None, ["sampling.greedy=true"], greedy=True)
    # values the overrides set are theirs: no file note
    with pytest.raises(ConfigError, match=r"^overrides sampling.greedy=true, sampling.top_k=5: .*but "
                                          r"sampling.top_k is 5: set sampling.top_k=0 too \(--greedy, "
                                          r"on the commands that have it, sets all three\)$"):
        load_run_config(None, ["sampling.greedy=true", "sampling.top_p=1.0", "sampling.top_k=5"])
    assert load_run_config(None, ["sampling.greedy=true", "sampling.top_p=1.0"]).sampling.greedy


def test_seeds_step_and_token_counts_are_bounded():
    """Seeds are 32-bit, step counts int32 and token counts at most 2^20: a huge value fails at load, naming the
    key, not as an overflow or an allocation deep inside a run."""
    assert load_config(None, [f"schedule.seed={SEED_MAX}"], RunConfig).schedule.seed == SEED_MAX
    for item, key in [(f"schedule.seed={SEED_MAX + 1}", "schedule.seed"),
                      ("schedule.seed=-1", "schedule.seed"),
                      ("sampling.max_new_tokens=99999999999999999999", "sampling.max_new_tokens"),
                      ("sampling.cache_tokens=99999999999999999999", "sampling.cache_tokens"),
                      ("sampling.buckets=[32,99999999999]", "sampling"),
                      ("schedule.group_size=100000000000", "schedule.group_size"),
                      ("schedule.total_updates=99999999999999999999999", "schedule.total_updates"),
                      (f"schedule.max_attempts={2**31}", "schedule.max_attempts"),
                      (f"optim.total_steps={2**31}", "optim.total_steps")]:
        with pytest.raises(ConfigError, match=f"override {re.escape(item)}: {key}: "):
            load_config(None, [item], RunConfig)
    for item, key in [(f"loss.horizon={2**20 + 1}", "loss.horizon"),
                      (f"loss.logprob_chunk={2**20 + 1}", "loss.logprob_chunk")]:
        with pytest.raises(ConfigError, match=f"override {re.escape(item)}: {key}: "):
            load_config(None, [item], RunConfig)
    assert load_config(None, [f"loss.horizon={2**20}"], RunConfig).loss.horizon == 2**20
    from jscenegen.sft.config import SFTRunConfig
    # the SFT optimizer's warmup redeclared without GRPO's bound: a 400-digit value ended in
    # an OverflowError building the schedule
    for item, key in [("sft.max_seq_len=99999999", "sft.max_seq_len"),
                      (f"sft.logprob_chunk={2**20 + 1}", "sft.logprob_chunk"),
                      (f"optim.warmup_steps={2**31}", "optim.warmup_steps")]:
        with pytest.raises(ConfigError, match=f"override {re.escape(item)}: {key}: "):
            load_config(None, [item], SFTRunConfig)
    assert load_config(None, [f"optim.warmup_steps={2**31 - 1}"], SFTRunConfig).optim.warmup_steps == 2**31 - 1
    assert seed_arg("7") == 7
    for text in ("-1", str(SEED_MAX + 1), "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            seed_arg(text)


def test_a_turn_longer_than_its_episode_is_refused():
    """sampling.max_new_tokens=2^20 with a 2,048-token episode passed, then sized a Qwen3.5
    fixed cache for a million slots a row: the process was killed for memory, with no message."""
    cfg = load_config(None, ["sampling.max_new_tokens=2048", "sampling.max_episode_tokens=2048"],
                      RunConfig)
    assert cfg.sampling.cache_slots() == 2048 + 2048 + 64
    with pytest.raises(ConfigError, match=r"sampling.max_new_tokens=2049: sampling: "
                       r"max_new_tokens 2049 exceeds max_episode_tokens 2048: a turn cannot "
                       r"outgrow its episode"):
        load_config(None, ["sampling.max_episode_tokens=2048", "sampling.max_new_tokens=2049"],
                    RunConfig)


def test_warm_start_sft_overrides_are_checked_with_their_origin_named():
    from jscenegen.pipeline import warm_start_sft_config

    cfg = load_config(None, ["warm_start.sft_overrides=[sft.steps=true]"], RunConfig)
    with pytest.raises(ConfigError, match=r"^warm_start \(sft_config .*sft.steps: .*not a boolean"):
        warm_start_sft_config(cfg)
    assert warm_start_sft_config(load_config(None, [], RunConfig)).sft.steps > 0


def test_the_keys_a_mapping_override_sets_count_where_an_override_is_looked_for():
    """`sampling={top_k: 5}` with --greedy lost the 5 without a word (the check read the
    override's written key, `sampling`), and a warm start's `model={path: ...}` collided with
    the model.path it is given (now refused as `model.path` is: the warm start does not read it)."""
    from jscenegen.pipeline import warm_start_sft_config
    from jscenegen.run_config import load_run_config

    with pytest.raises(ConfigError, match=r"^--greedy sets .*the override sampling=\{top_k: 5\} contradicts"):
        load_run_config(None, ["sampling={top_k: 5}"], greedy=True)
    cfg = load_config(None, ['warm_start.sft_overrides=["model={path: /elsewhere}"]'], RunConfig)
    with pytest.raises(ConfigError, match=r"^warm_start \(.*\): model.path: not read by the warm start"):
        warm_start_sft_config(cfg)


def test_a_yaml_bomb_is_refused_before_it_expands(tmp_path):
    """"Billion laughs": nine lines whose aliases expand to 9^9 values. Refused by counting the
    expanded values over the composed nodes (each once), in well under a second."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    f = tmp_path / "bomb.yaml"
    f.write_text("\n".join(lines + ["model: {remat: *i}"]) + "\n")
    with pytest.raises(ConfigError, match=rf"^{f}: its aliases expand to more than 1,000,000 values"):
        read_yaml(f)
    f.write_text("\n".join(lines[:5] + ["optim: {lr: 1.0e-5}"]) + "\n")   # 9^5 values: fine
    assert read_yaml(f)["optim"] == {"lr": 1.0e-5}
    with open(f, "ab") as out:     # sparse: the size without the bytes
        out.truncate(2**20 + 1)
    with pytest.raises(ConfigError, match=rf"^config file {f}: 1,048,577 bytes; a config is at most"):
        read_yaml(f)


def test_merge_keys_merge_and_the_mappings_own_keys_win(tmp_path):
    f = tmp_path / "merge.yaml"
    f.write_text("optim:\n  <<: &base {lr: 1.0e-5, weight_decay: 0.1}\n  weight_decay: 0.0\n")
    assert load_config(f, [], RunConfig).optim.lr == 1.0e-5
    assert load_config(f, [], RunConfig).optim.weight_decay == 0.0


def test_an_override_given_twice_is_refused_and_a_long_bad_value_is_cut(tmp_path):
    with pytest.raises(ConfigError, match=r"^override model.remat=false: model.remat is already "
                                          r"set by override model.remat=true; give each key once$"):
        load_config(None, ["model.remat=true", "model.remat=false"], RunConfig)
    with pytest.raises(ConfigError, match=r"^override 'schedule.train_set': schedule is a value "
                                          r"set by override schedule=5, not a section$"):
        load_config(None, ["schedule=5", "schedule.train_set=x"], RunConfig)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["schedule.roles=" + "[" + ",".join(["D"] * 10000) + "]"], RunConfig)
    msg = str(info.value)
    assert len(msg) < 600 and "... (" in msg and "characters)" in msg, msg


def test_a_mapping_override_sets_its_keys_and_keeps_the_sections_others(tmp_path):
    """`schedule={group_size: 8}` replaced the whole section: the file's other schedule keys
    went back to their defaults without a word, and a key also given alone was dropped or kept
    by the overrides' order."""
    f = tmp_path / "c.yaml"
    f.write_text("schedule:\n  total_updates: 1\n  max_redraws: 1\nsampling:\n  top_k: 7\n")
    cfg = load_config(f, ["schedule={group_size: 4}", "sampling={}"], RunConfig)
    assert (cfg.schedule.group_size, cfg.schedule.total_updates, cfg.schedule.max_redraws) == (4, 1, 1)
    assert cfg.sampling.top_k == 7   # an empty mapping merges nothing
    for override, why in (("bogus={}", "unknown key 'bogus'"), ("schedule={bogus: {}}", "unknown key 'schedule.bogus'"),
                          ("schedule.total_updates={}", "schedule.total_updates: Input should be a valid integer")):
        with pytest.raises(ConfigError, match=rf"^override {re.escape(override)}: {re.escape(why)}"):
            load_config(f, [override], RunConfig)   # an empty mapping's key is still validated
    cfg = load_config(f, ["schedule.total_updates=5", "schedule={group_size: 4}"], RunConfig)
    assert (cfg.schedule.group_size, cfg.schedule.total_updates) == (4, 5)
    for overrides in (["schedule.total_updates=5", "schedule={total_updates: 3}"],
                      ["schedule={total_updates: 3}", "schedule.total_updates=5"]):
        with pytest.raises(ConfigError, match=rf"^override {re.escape(overrides[1])}: schedule.total_updates "
                                              rf"is already set by override {re.escape(overrides[0])}; give each key once$"):
            load_config(f, overrides, RunConfig)
    with pytest.raises(ConfigError, match=r"^override schedule=\{group_size: 0\}: schedule.group_size: Input should be greater"):
        load_config(f, ["schedule={group_size: 0}"], RunConfig)


def test_an_override_under_a_value_of_the_file_blames_the_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("schedule: [a, b]\n")
    with pytest.raises(ConfigError, match=r"^override 'schedule.total_updates': schedule is a value in the "
                                          r"config file, not a section$"):
        load_config(f, ["schedule.total_updates=1"], RunConfig)


@pytest.mark.parametrize("text,expected", [
    ("schedule:\n  roles: &a [*a]\n", "an alias refers to a value that contains it"),
    ("schedule: &s\n  seed: 1\n  <<: *s\n", "an alias refers to a value that contains it"),
    ("schedule:\n  ? [a, b]\n  : 1\n", r"2:5: not valid YAML: a key that is not a scalar \(list\)"),
    ("schedule:\n  roles: " + "[" * 50000 + "]" * 50000 + "\n", "nested too deeply"),
])
def test_recursive_unhashable_or_deep_yaml_is_one_line_at_once(tmp_path, text, expected):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{f}:? ?{expected}"):
        read_yaml(f)


def test_an_override_value_has_the_config_files_guards():
    deep = "schedule.seed=" + "[" * 30000 + "]" * 30000
    with pytest.raises(ConfigError, match=r"^override schedule\.seed=\[+\.\.\. \(60,014 characters\): nested too deeply$"):
        load_config(None, [deep], RunConfig)
    with pytest.raises(ConfigError, match="an alias refers to a value that contains it"):
        load_config(None, ["schedule.roles=&a [*a]"], RunConfig)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["schedule." + "a" * 100000 + "=1"], RunConfig)
    assert len(str(info.value)) < 600


def test_cudnn_attention_runs_as_xla_off_gpu_with_a_warning(caplog):
    """configs/grpo100.yaml asks for cudnn and promises xla on CPU: on CPU every episode of an
    eval failed with "cuDNN is not detected" (a masked report, exit 0)."""
    import jax

    from jscenegen.model.options import ModelConfig, attention_for_backend

    assert jax.default_backend() == "cpu"
    attention_for_backend.cache_clear()     # another test may have asked already
    with caplog.at_level("WARNING"):
        for _ in range(2):                  # eval's policy and reference: one warning
            assert ModelConfig(attention="cudnn").build_options()["attn_impl"] == "xla"
    assert caplog.text.count("model.attention=cudnn needs a GPU; the cpu backend runs xla attention") == 1
    assert ModelConfig().build_options()["attn_impl"] == "xla"


def test_cudnn_attention_with_float32_compute_runs_as_xla_on_gpu_with_a_warning(monkeypatch, caplog):
    """cuDNN's kernel takes bf16/fp16 only: with model.compute_dtype float32 jax raised
    "Unsupported dtype for inputs" at the first traced step, after the model was loaded. The
    GPU backend is faked (jax.default_backend); bfloat16 keeps cudnn there."""
    import jax

    from jscenegen.model.options import ModelConfig, attention_for_backend

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    attention_for_backend.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            fp32 = ModelConfig(attention="cudnn", compute_dtype="float32").build_options()
            bf16 = ModelConfig(attention="cudnn", compute_dtype="bfloat16").build_options()
    finally:
        attention_for_backend.cache_clear()    # no fake answer left for another test
    assert (fp32["attn_impl"], bf16["attn_impl"]) == ("xla", "cudnn")
    assert caplog.messages == ["model.attention=cudnn takes bfloat16 or float16 inputs only; with "
                               "model.compute_dtype=float32 the GPU runs xla attention"]


def test_docs_config_md_lists_every_key_with_its_meaning_and_is_current():
    """docs/config.md is the generated reference: every leaf key of RunConfig, each with a
    description, its default and the CPU default's value; regenerate it with
    `python -m jscenegen.run_config > docs/config.md` after a schema change."""
    from pathlib import Path

    from jscenegen.config import config_fields
    from jscenegen.run_config import REFERENCE_PATH, config_reference, load_run_config
    from jscenegen.sft.config import SFTRunConfig

    rows = config_fields(RunConfig, load_run_config(None))
    assert [key for key, *_, description in rows if not description] == []
    assert [key for key, *_, description in config_fields(SFTRunConfig) if not description] == []
    text = config_reference()
    for key, _, default, cpu, _ in rows:
        line = next(line for line in text.splitlines() if line.startswith(f"| `{key}` |"))
        assert (line.split(" | ")[3] == "=") == (cpu == default), line
    assert "| `optim.lr` | float >= 0, <= 1 | 1e-06 | 5e-05 |" in text  # cpu-default.yaml's lr
    assert "| `loss.loss_agg_mode` | token-mean \\| seq-mean-token-sum" in text
    assert "| `sft.steps` | int >= 1, <= 2147483647 | 40 | 300 |" in text   # configs/sft-cpu.yaml's steps
    path = Path(__file__).resolve().parents[1] / REFERENCE_PATH
    assert path.read_text() == text, f"{REFERENCE_PATH} is stale: python -m jscenegen.run_config > {REFERENCE_PATH}"


@pytest.mark.parametrize("override, why", [
    ("scene.metrics.agent_radius_m=1000", r"scene.metrics: .*agent_radius_m \+ access_margin_m = "
     r"1000.1 m is 20,002 cells of cell_m 0.05 m; at most 31$"),
    ("scene.metrics.access_margin_m=1e300", r"scene.metrics: agent_radius_m \+ access_margin_m = "
     r"1e\+300 m is [0-9,]+ cells"),
    # 32 cells: the JAX kernel's packed shifts disagreed with NumPy past 31 (helper-173)
    ("scene.metrics.access_margin_m=1.46", r"scene.metrics: .* = 1.61 m is 32 cells of cell_m 0.05 m; at most 31$"),
    ("scene.metrics.cell_m=1e300", r"scene.metrics.cell_m: .*less than or equal to 1"),
    ("scene.metrics.min_region_m2=1e308", r"scene.metrics.min_region_m2: .*less than or equal to")])
def test_reachability_sizes_the_grid_cannot_draw_are_refused_by_the_config(override, why):
    """agent_radius_m=1000 hung `scene check`, `design` and `train` (the latter after its SFT
    warm start) drawing a 40,000-cell disk; cell_m=1e300 and a huge min_region_m2 were an
    OverflowError traceback (helper-172)."""
    from jscenegen.run_config import load_run_config

    with pytest.raises(ConfigError, match=rf"override {re.escape(override)}: {why}"):
        load_run_config(None, [override])
    assert load_run_config(None, ["scene.metrics.access_margin_m=1.4"]).scene.metrics.access_margin_m == 1.4


def test_a_reachability_cell_that_is_not_whole_even_millimetres_is_refused_by_the_config():
    """scene.metrics.cell_m=0.015 was accepted, then every episode failed at its start (and the
    trainer raised IndexError on the empty batch); the config refuses it, naming the key."""
    from jscenegen.run_config import load_run_config

    for bad in ("0.015", "0.051", "0.0105", "1e-10", "0.0004"):   # 0 mm: every measure divided by 0
        with pytest.raises(ConfigError, match=rf"override scene.metrics.cell_m={bad}: "
                                              r"scene.metrics.cell_m: .*not a whole even number "
                                              r"of millimetres"):
            load_run_config(None, [f"scene.metrics.cell_m={bad}"])
    assert load_run_config(None, ["scene.metrics.cell_m=0.04"]).scene.metrics.cell_m == 0.04


def test_a_config_with_many_errors_lists_the_first_twenty_and_counts_the_rest(tmp_path):
    """200,000 unknown keys built a 10 MB message (then cut to 2 KB) after ~30 s of work."""
    f = tmp_path / "run.yaml"
    f.write_text("schedule:\n" + "".join(f"  k{i}: {i}\n" for i in range(30)))
    with pytest.raises(ConfigError) as info:
        load_config(f, [], RunConfig)
    lines = str(info.value).splitlines()
    assert lines[:2] == [f"{f}: unknown key 'schedule.k0'", f"{f}: unknown key 'schedule.k1'"]
    assert len(lines) == 21 and lines[-1] == "... and 10 more errors"


def test_printed_text_escapes_controls_and_bidirectional_overrides():
    """ESC and BEL were escaped, but U+202E (right-to-left override) in a prompt or a sampled
    token reached the terminal raw and reordered how the rest showed (helper-90); letters,
    accents and the zero-width joiner of emoji sequences stay as they are."""
    from jscenegen.text import terminal_line, terminal_text

    assert terminal_text("bed \x1b[2J\x07\u202e x\u2066y\u200f\n") == \
        "bed \\x1b[2J\\x07\\u202e x\\u2066y\\u200f\n"
    assert terminal_line("a\nb") == "a\\nb"
    assert terminal_text("Japandi für zwei ü \U0001F468\u200d\U0001F469") == \
        "Japandi für zwei ü \U0001F468\u200d\U0001F469"


def test_the_http_judge_keys_are_those_the_rule_judge_does_not_read():
    """Derived by exclusion from JudgeConfig: a new key the rule judge reads must join
    _RULE_JUDGE_KEYS, one both language-model judges (http, model) read _LM_JUDGE_KEYS, or it
    is warned about as having no effect without the http judge."""
    from jscenegen.run_config import _HTTP_JUDGE_KEYS, _LM_JUDGE_KEYS

    assert _HTTP_JUDGE_KEYS == ("base_url", "model", "api_key_env", "timeout_s", "max_retries",
                                "backoff_s")
    assert _LM_JUDGE_KEYS == ("enforce_caps", "temperature", "max_tokens", "concurrency")


def test_keys_set_where_they_have_no_effect_are_named(caplog):
    """`judge.base_url` and `judge.model` without `judge.backend: http` graded with the rule
    judge without a word (a forgotten backend line); the shipped configs set none such."""
    from jscenegen.run_config import inert_settings, load_run_config, warn_inert_settings

    for shipped in (None, "configs/cpu-qwen35.yaml", "configs/grpo100.yaml"):
        assert inert_settings(load_run_config(shipped)) == []
    cfg = load_run_config(None, ["judge.base_url=http://x/v1", "judge.model=m", "judge.timeout_s=120",
                                 "loss.horizon=5", "loss.kl_coef=0.1", "model.remat=false",
                                 "model.remat_policy=minimal", "model.reference_path=/ref"])
    assert inert_settings(cfg) == [
        "judge.base_url, judge.model have no effect without judge.backend: http",
        "loss.horizon has no effect without loss.loss_agg_mode: seq-mean-token-sum-norm",
        "loss.kl_coef has no effect without loss.use_kl_loss: true",
        "model.reference_path has no effect without loss.use_kl_loss: true",
        "model.remat_policy has no effect without model.remat: true"]   # timeout_s: its default
    assert inert_settings(load_run_config(None, ["judge.backend=http", "judge.base_url=http://x/v1",
                                                 "judge.model=m", "loss.use_kl_loss=true",
                                                 "loss.kl_coef=0.1"])) == []
    with caplog.at_level("WARNING"):
        warn_inert_settings(cfg)
    assert [r.getMessage() for r in caplog.records] == inert_settings(cfg)
    assert inert_settings(cfg, sections=("judge",)) == inert_settings(cfg)[:1]   # eval, design
    # a greedy evaluation plays one episode per scene: the CPU default's 16 would be ignored
    assert inert_settings(load_run_config(None, greedy=True)) == [
        "trainer.eval_samples has no effect without sampling.greedy: false"]


def test_warm_start_keys_beside_a_model_path_are_named():
    """`warm_start.*` is read only without `model.path`: set beside one it was ignored without
    a word; the CPU default's own warm start (what `train model.path=DIR` reads) is not named."""
    from jscenegen.run_config import inert_settings, load_run_config

    assert inert_settings(load_run_config(None, ["model.path=/m"])) == []
    assert inert_settings(load_run_config(None, ["warm_start.preset=small", "warm_start.arch=qwen2"])) == []
    assert inert_settings(load_run_config(None, ["model.path=/m", "warm_start.preset=small",
                                                 "warm_start.sft_config=null"])) == [
        "warm_start.preset, warm_start.sft_config have no effect without model.path: null (a run "
        "given a model makes none)"]
    assert inert_settings(load_run_config("configs/grpo100.yaml", [
        "model.path=/m", "warm_start.sft_overrides=[sft.steps=2]"])) == [
        "warm_start.sft_overrides has no effect without model.path: null (a run given a model "
        "makes none)"]


@pytest.mark.parametrize("override,why", [
    ('schedule.total_updates="3"', 'expected a number, not a string (got "3")'),
    ("schedule.total_updates=2.0", "expected an integer, not 2.0"),
    ("mesh.fsdp=true", "expected a number, not a boolean"),
    ("model.remat=0", "expected true or false, not 0"),
    ('sampling.greedy="true"', 'expected true or false, not "true"'),
    ("sampling.buckets=[64, 128.0]", "expected an integer, not 128.0")])
def test_a_value_pydantic_would_convert_is_refused(override, why):
    """Pydantic's lax mode read "3" as 3, 2.0 as 2 and 0 as false."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^override {re.escape(override)}: {re.escape(key)}: {re.escape(why)}"):
        load_config(None, [override], RunConfig)


def test_a_refusal_that_names_its_value_does_not_repeat_it():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.remat=on"], RunConfig)
    assert str(info.value) == 'override model.remat=on: model.remat: expected true or false, not "on"'


def test_a_field_that_takes_text_and_numbers_keeps_its_text():
    from typing import Literal

    from jscenegen.config import wrong_scalar_type

    mixed = int | Literal["auto"]
    assert wrong_scalar_type(mixed, "auto") is None and wrong_scalar_type(mixed, 3) is None
    assert wrong_scalar_type(mixed, True) == "expected a number, not a boolean"
    assert wrong_scalar_type(int, "auto") == wrong_scalar_type(int, "") == "expected a number, not a string"
    assert wrong_scalar_type(float, "-inf") == "expected a finite number"


def test_booleans_and_numbers_are_read_as_yaml_1_2_reads_them(tmp_path):
    """PyYAML's YAML 1.1 read `1e-6` and `2.5e6` as text, `010` as octal 8, `1:30` as base-60
    90 and `yes`/`on` as booleans: a seed written with a leading zero became another number."""
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  lr: 1e-6\n  eps: 1E-8\n  weight_decay: 2.5e-1\nschedule:\n  seed: 010\n")
    cfg = load_config(f, ["loss.kl_coef=2e-3", "judge.timeout_s=1.2e2", "logging.experiment=yes"], RunConfig)
    assert (cfg.optim.lr, cfg.optim.eps, cfg.optim.weight_decay, cfg.loss.kl_coef) == (1e-6, 1e-8, 0.25, 2e-3)
    assert (cfg.schedule.seed, cfg.judge.timeout_s, cfg.logging.experiment) == (10, 120.0, "yes")
    assert load_config(None, ["judge.model='1e5'"], RunConfig).judge.model == "1e5"   # quoted: text
    for override, why in (("schedule.seed=1:30", "expected a number, not a string"),
                          ("schedule.total_updates=1_000", "expected a number, not a string"),
                          ("model.remat=on", 'expected true or false, not "on"'),
                          ("schedule.total_updates=4.0e0", "expected an integer, not 4.0")):
        with pytest.raises(ConfigError, match=re.escape(why)):
            load_config(None, [override], RunConfig)


def test_a_saved_config_reads_back_as_written(tmp_path):
    """`3e5` is a number to the config reader: a string of that form (an experiment name, a
    short git hash) was saved unquoted in the run's config.yaml, and the resume then refused it."""
    from jscenegen.config import dump_yaml

    cfg = load_config(None, ['logging.experiment="8e31234"', "optim.lr=3e-6"], RunConfig)
    f = tmp_path / "config.yaml"
    f.write_text(dump_yaml(cfg.model_dump(mode="json")))
    assert load_config(f, [], RunConfig) == cfg
    import yaml  # and a YAML 1.1 reader (PyYAML's safe_load, Hydra) reads text as text
    odd = {"a": "yes", "b": "010", "c": "1:30", "d": "2.5e6", "e": "true", "f": 1e-6, "g": True}
    assert yaml.safe_load(dump_yaml(odd)) == odd


def test_an_integer_beyond_pythons_digit_limit_names_file_line_and_column(tmp_path):
    """int() refuses more than 4,300 digits with advice for programmers
    (sys.set_int_max_str_digits), naming no file, line or key."""
    path = tmp_path / "c.yaml"
    path.write_text("schedule:\n  total_updates: " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}:2:18: not valid YAML: an "
                                          r"integer of 5,000 digits$"):
        read_yaml(path)


def test_an_override_of_a_section_leaves_a_yaml_alias_of_it_alone():
    from jscenegen.config import apply_overrides

    shared = {"temperature": 0.7}
    out = apply_overrides({"sampling": shared, "judge": shared}, ["sampling.temperature=1.0"])
    assert out == {"sampling": {"temperature": 1.0}, "judge": {"temperature": 0.7}}
    assert shared == {"temperature": 0.7}


@pytest.mark.parametrize("value,tag", [("!!binary aGVsbG8=", "binary"), ("!!set {a, b}", "set"),
                                       ("!!omap [a: 1]", "omap")])
def test_yaml_tags_a_config_never_holds_are_refused_naming_the_place(tmp_path, value, tag):
    """`!!binary` reached a string field as its decoded text, a `!!set` in an order that is
    the hash seed's."""
    path = tmp_path / "c.yaml"
    path.write_text(f"model:\n  path: {value}\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}:2:9: not valid YAML: the "
                                          rf"tag '{tag}': a config holds strings"):
        read_yaml(path)


@pytest.mark.parametrize("item,problem", [
    ("sampling={top_k: 1, top_k: 2}", "duplicate key 'top_k'"),
    ("sampling.stop_strings=[a, b", "expected ',' or ']', but got '<stream end>' (while parsing a "
                                    "flow sequence at line 1, column 1)"),
])
def test_an_override_opening_a_list_or_mapping_must_be_valid_yaml(item, problem):
    """Read as plain text, it was refused as "not a valid dictionary/tuple (got the text)",
    hiding the YAML problem."""
    from jscenegen.config import apply_overrides

    with pytest.raises(ConfigError, match=rf"^override {re.escape(item)}: not valid YAML: "
                                          rf"{re.escape(problem)}$"):
        apply_overrides({}, [item])
    assert apply_overrides({}, ["model.path=a: b: c"]) == {"model": {"path": "a: b: c"}}  # text


def test_the_reward_settings_are_bounded_so_every_reward_lies_in_minus_one_to_one():
    """`failure_reward` and `unit_penalty` took any float: an evaluation report's check could not
    know the reward's range (it refused rewards above 1 whatever the settings)."""
    from jscenegen.run_config import load_run_config
    from jscenegen.scene.config import REWARD_MAX, REWARD_MIN

    assert (REWARD_MIN, REWARD_MAX) == (-1.0, 1.0)
    for override, why in (("scene.reward.failure_reward=-2", "greater than or equal to -1"),
                          ("scene.reward.failure_reward=0.5", "less than or equal to 0"),
                          ("scene.reward.unit_penalty=1.5", "less than or equal to 1"),
                          ("scene.reward.unit_penalty=-0.1", "greater than or equal to 0")):
        with pytest.raises(ConfigError, match=rf"^override {re.escape(override)}: .*{why}"):
            load_run_config(None, [override])
    cfg = load_run_config(None, ["scene.reward.failure_reward=-0.5", "scene.reward.unit_penalty=1"])
    assert (cfg.scene.reward.failure_reward, cfg.scene.reward.unit_penalty) == (-0.5, 1.0)


@pytest.mark.parametrize("override,key", [
    ("scene.budget_units=99999999999999999999999", "scene.budget_units"),
    ("scene.op_costs.add_object=2000000", "scene.op_costs.add_object"),
    ("scene.reward.unit_norm=2000000", "scene.reward.unit_norm"),
    ("scene.max_planner_turns=100000", "scene.max_planner_turns"),
])
def test_budget_and_turn_counts_are_bounded(override, key):
    """The budget was unbounded: a 23-digit value was accepted and written into the prompts."""
    from jscenegen.run_config import load_run_config

    with pytest.raises(ConfigError, match=rf"{key}: Input should be less than or equal to"):
        load_run_config(None, [override])


def test_top_k_minus_one_is_verls_spelling_of_off():
    """A VERL config's `top_k: -1` (vLLM's "off") was refused; other negatives still are."""
    from jscenegen.run_config import load_run_config

    assert load_run_config(None, ["sampling.top_k=-1"]).sampling.top_k == 0
    with pytest.raises(ConfigError, match=r"sampling\.top_k.*greater than or equal to 0"):
        load_run_config(None, ["sampling.top_k=-2"])
