"""The GRPO loop: a smoke run, exact resume after SIGTERM, refusals, and the CPU default config."""
import functools
import json
import logging
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jscenegen.checkpoint.resume import ResumeError
from jscenegen.checkpoint.store import CheckpointStore, check_step, read_train_state
from jscenegen.config import ConfigError, load_config
from jscenegen.grpo.train.trainer import Trainer, constant_horizon
from jscenegen.model.config import QwenConfig
from jscenegen.model.weights import param_shapes
from jscenegen.paths import resolve_data_path
from jscenegen.run_config import RunConfig

from chat_fixtures import chat_model_dir

TIMING_KEYS = ("time/", "rollout/tokens_per_s", "rollout/reshard_s", "judge/latency_s")


_OVERRIDES = (
    "mesh.fsdp=3", "mesh.sp=2",
    "sampling.max_new_tokens=8", "sampling.max_episode_tokens=2560",
    "sampling.buckets=[64,256,1024,2048,4096]",
    "schedule.num_scenes=3", "schedule.group_size=2", "schedule.total_updates=3",
    "schedule.roles=PPC",           # a random model never gets past the planner's first turn
    "schedule.zero_spread=count",   # ... nor has signal: step anyway
    "loss.entropy_coeff=0.01",      # ... with a real, non-zero gradient
    "optim.lr=1e-3", "checkpoint.save_every=1", "checkpoint.keep_last=2",
    # an LR that differs at every count (1, 0.85, 0.5, 0.15 x optim.lr): a resume that lost its
    # scheduler position (lr_step) takes other updates than a straight run
    "optim.lr_schedule=cosine", "optim.total_steps=4",
    "logging.swanlab_mode=disabled", "trainer.progress=false",
)


def _cfg(**extra):
    settings = dict(item.split("=", 1) for item in (f"model.path={chat_model_dir()}", *_OVERRIDES))
    settings.update({k: str(v) for k, v in extra.items()})   # `extra` replaces a default
    return load_config(resolve_data_path("configs/cpu-default.yaml"),
                       [f"{k}={v}" for k, v in settings.items()], RunConfig)


def _run(run_dir, *, resume=False, max_updates=None, sigterm_after=None, model_dir=None, **extra):
    model_dir = model_dir or chat_model_dir()
    trainer = Trainer(_cfg(**{"model.path": str(model_dir), **extra}), run_dir, model_dir,
                      resume=resume)

    def progress(row):
        if sigterm_after is not None and row["attempt"] + 1 == sigterm_after:
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        return trainer, trainer.run(max_updates, progress=progress)
    finally:
        trainer.close()


def _final(run_dir):
    store = CheckpointStore(run_dir / "checkpoints")
    ck = store.restore()
    store.close()
    return ck


def _metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_KEYS)} for r in rows]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    _, summary = _run(run_dir)
    return run_dir, summary


def test_a_run_writes_metrics_checkpoints_metadata_and_checksums(straight):
    run_dir, summary = straight
    assert summary.attempts == 3 and summary.effective_updates == 3
    assert summary.optimizer_steps == 3
    rows = _metrics(run_dir)
    assert [r["attempt"] for r in rows] == [0, 1, 2]
    assert [r["role"] for r in rows] == ["planner", "planner", "critic"]
    assert all(r["stepped"] for r in rows)
    planner = [r for r in rows if r["role"] == "planner"]
    assert all(r["trained_tokens"] > 0 and r["train/grad_norm"] > 0 for r in planner)
    # one mini-batch, one epoch: the old log-probs are the loss pass's own, the ratio exactly 1
    assert all(r["train/ratio_max"] == 1.0 and r["train/clipfrac"] == 0.0 for r in planner)
    critic = [r for r in rows if r["role"] == "critic"]
    assert all(r["trained_tokens"] == 0 and r["train/grad_norm"] == 0 for r in critic)
    assert not any("train/kl" in r for r in rows)   # no KL loss, no reference: no KL column
    assert rows[0]["episodes"] == 2
    # 2 episodes on the replicated layout of 6 devices: 6 rows, 4 of them padding; after each
    # step one reshard writes the whole weights (fp32) onto each of the 6 devices
    assert rows[0]["rollout/batch_rows"] == 6 and rows[0]["rollout/padding_rows"] == 4
    n_params = sum(int(np.prod(s)) for s in param_shapes(QwenConfig.from_dir(chat_model_dir())).values())
    raw = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rollout/reshard_bytes"] == 6 * 4 * n_params and r["rollout/reshard_s"] > 0
               for r in raw)
    steps = CheckpointStore(run_dir / "checkpoints").steps()
    assert steps == [2, 3]  # save_every 1, keep_last 2
    status = check_step(run_dir / "checkpoints" / "3")
    assert status.valid, status.reason
    meta = json.loads((run_dir / "checkpoints/3/training_metadata.json").read_text())
    assert meta["optimizer_step"] == 3 and meta["effective_updates"] == 3
    assert len(meta["protocol_hash"]) == 64 and len(meta["schedule_hash"]) == 64
    assert meta["judge"]["backend"] == "rule"
    assert json.loads((run_dir / "checkpoints/3/checksums.json").read_text())["files"]
    state = read_train_state(run_dir / "checkpoints" / "3")
    assert state["schedule"]["attempts"] == 3 and state["lr_step"] == 3


def test_bf16_parameters_train_save_and_resume_with_fp32_adam_moments(tmp_path, caplog):
    """model.param_dtype=bfloat16 (the README's "fp32 or bf16 params"): the moments were
    created bf16, and the first checkpoint save refused them after the update had run. The
    run warns that bf16 weights round small steps away (no fp32 master weights)."""
    bf16 = {"model.param_dtype": "bfloat16", "model.compute_dtype": "bfloat16",
            "schedule.total_updates": 1}
    with caplog.at_level("WARNING"):
        _, summary = _run(tmp_path / "run", **bf16)
    assert any("no fp32 master weights" in r.getMessage() and "0.001" in r.getMessage()
               for r in caplog.records)
    assert summary.optimizer_steps == 1 and summary.checkpoint is not None
    ck = _final(tmp_path / "run")
    assert {str(a.dtype) for a in ck.params.values()} == {"bfloat16"}
    assert {str(a.dtype) for a in ck.adam["mu"].values()} == {"float32"}
    assert any(np.abs(np.asarray(a)).max() > 0 for a in ck.adam["mu"].values())
    hf_config = json.loads((Path(summary.checkpoint) / "hf" / "config.json").read_text())
    assert {hf_config[k] for k in ("dtype", "torch_dtype") if k in hf_config} == {"bfloat16"}
    _, resumed = _run(tmp_path / "run", resume=True, **{**bf16, "schedule.total_updates": 2})
    assert resumed.optimizer_steps == 2


def test_a_trainer_checkpoint_keeps_its_lr_scheduler_position_in_verl_files(straight):
    """The trainer's train state names its LR count `lr_step` (converted ones
    `lr_schedule_count`): the VERL scheduler state must carry it, not restart at 0."""
    from convert.orbax_directions import orbax_state, orbax_step_dir

    run_dir, _ = straight
    state = orbax_state(orbax_step_dir(run_dir / "checkpoints" / "3"), 4)
    assert state.global_step == 3 and state.adam.step == 3
    (extra,) = state.extra_states
    assert extra["lr_scheduler"]["last_epoch"] == 3 and extra["lr_scheduler"]["_step_count"] == 4
    assert state.train_state == read_train_state(run_dir / "checkpoints" / "3")  # the run's identity


def test_sigterm_then_resume_is_bitwise_identical_to_a_straight_run(straight, tmp_path, monkeypatch):
    run_dir, _ = straight
    _, first = _run(tmp_path, sigterm_after=1)
    assert first.stopped_by_signal and first.attempts == 1
    assert check_step(tmp_path / "checkpoints" / "1").valid
    restored = []
    apply = Trainer._apply_checkpoint

    def recording(self, ck):
        apply(self, ck)
        restored.append((self.state.lr_step.sharding, self.state.skipped_steps.sharding))

    monkeypatch.setattr(Trainer, "_apply_checkpoint", recording)
    _, second = _run(tmp_path, resume=True)
    assert second.attempts == 3
    # the restored counters are replicated on the mesh, as the step returns them (a
    # single-device counter compiled the step a second time)
    for sharding in restored[0]:
        assert isinstance(sharding, NamedSharding) and sharding.spec == P(), sharding
    a, b = _final(run_dir), _final(tmp_path)
    assert int(a.adam["count"]) == int(b.adam["count"]) == 3
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name], err_msg=name)
        np.testing.assert_array_equal(a.adam["mu"][name], b.adam["mu"][name], err_msg=name)
        np.testing.assert_array_equal(a.adam["nu"][name], b.adam["nu"][name], err_msg=name)
    assert np.abs(a.adam["mu"]["model.norm.weight"]).max() > 0  # the moments really moved
    # the whole train state: schedule position, LR-scheduler count, skipped steps, hashes
    assert a.train_state == b.train_state and b.train_state["lr_step"] == 3
    assert _metrics(run_dir) == _metrics(tmp_path)


def test_async_saves_stop_and_resume_to_the_straight_runs_state(straight, tmp_path):
    """checkpoint.async_save: orbax writes each step's arrays in the background, the step is
    completed (hf/, metadata, checksums) by the next save or at the stop; a SIGTERM after the
    first update leaves a complete step 1, and the resume (async too) ends on the straight
    (synchronous) run's train state, bitwise, with every kept step complete."""
    run_dir, _ = straight
    trainer, first = _run(tmp_path, sigterm_after=1, **{"checkpoint.async_save": "true"})
    assert trainer.store.async_save and first.stopped_by_signal and first.attempts == 1
    assert check_step(tmp_path / "checkpoints" / "1").valid
    _, second = _run(tmp_path, resume=True, **{"checkpoint.async_save": "true"})
    assert second.attempts == 3
    kept = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == [2, 3] and all(check_step(tmp_path / "checkpoints" / str(k)).valid for k in kept)
    a, b = _final(run_dir), _final(tmp_path)
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name], err_msg=name)
        np.testing.assert_array_equal(a.adam["mu"][name], b.adam["mu"][name], err_msg=name)
        np.testing.assert_array_equal(a.adam["nu"][name], b.adam["nu"][name], err_msg=name)
    assert a.train_state == b.train_state and b.train_state["lr_step"] == 3
    assert _metrics(run_dir) == _metrics(tmp_path)


@pytest.mark.slow  # three trainers with a KL reference each: 22-28 s on 2 cores
def test_a_resumed_run_keeps_the_initial_policy_as_its_kl_reference(tmp_path):
    """use_kl_loss without model.reference_path: the reference is the initial policy, on
    resume too (it was the checkpoint's weights, so the resumed updates' KL restarted at 0):
    stopped after 1 update and resumed equals 2 straight updates bitwise; a resumed run whose
    model directory lost its weights is refused, naming model.reference_path."""
    kl = {"loss.use_kl_loss": "true", "loss.kl_coef": 1.0, "loss.kl_loss_type": "k3",
          "schedule.total_updates": 2}
    _, straight = _run(tmp_path / "straight", **kl)
    _, first = _run(tmp_path / "resumed", max_updates=1, **kl)
    assert first.attempts == 1
    _, second = _run(tmp_path / "resumed", resume=True, **kl)
    assert straight.attempts == second.attempts == 2
    a, b = _final(tmp_path / "straight"), _final(tmp_path / "resumed")
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name], err_msg=name)
    rows = _metrics(tmp_path / "straight")
    assert rows[1]["train/kl"] > 0 and rows == _metrics(tmp_path / "resumed")
    import shutil

    moved = shutil.copytree(chat_model_dir(), tmp_path / "assets",
                            ignore=shutil.ignore_patterns("*.safetensors*"))
    with pytest.raises(ResumeError, match="model.reference_path"):
        _run(tmp_path / "resumed", resume=True, model_dir=moved,
             **{**kl, "schedule.total_updates": 3})


def test_a_reference_of_another_size_is_refused_before_a_resume_rewrites_its_config(straight, tmp_path, capsys):
    """model.reference_path of another architecture or size failed at the first update
    ("Incorrect number of leaves"), after a resume had written its overrides to config.yaml
    (every later resume then failed the same way); now it is refused first, naming the key
    and the first tensor that differs, and config.yaml is left as it was."""
    import shutil

    from jscenegen.cli import main

    other = shutil.copytree(chat_model_dir(), tmp_path / "wider")
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=2 * cfg["intermediate_size"])))
    import yaml

    run = shutil.copytree(straight[0], tmp_path / "run")   # made by Trainer: no config.yaml yet
    (run / "config.yaml").write_text(yaml.safe_dump(_cfg().model_dump(mode="json")))
    saved = (run / "config.yaml").read_text()
    assert main(["train", "--resume", str(run), "loss.use_kl_loss=true",
                 f"model.reference_path={other}", "schedule.total_updates=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: model.reference_path {other}: the KL reference must have")
    import re

    assert re.search(r"model\.layers\.0\.mlp\.gate_proj\.weight is \(\d+, \d+\) there, \(\d+, "
                     r"\d+\) in the policy \(6 tensors differ\)$", err), err
    assert (run / "config.yaml").read_text() == saved
    # the same shapes computed otherwise, a missing directory: refused, the key named
    from types import SimpleNamespace

    check = functools.partial(Trainer._check_reference,
                              SimpleNamespace(cfg=_cfg(), arch=QwenConfig.from_dir(chat_model_dir())))
    rope = shutil.copytree(chat_model_dir(), tmp_path / "rope")
    (rope / "config.json").write_text(json.dumps(dict(cfg, rope_theta=2 * cfg["rope_theta"])))
    with pytest.raises(ValueError, match=r"model.reference_path .*policy's modules, but its "
                                         r"rope_theta is \d+.0 there"):
        check(str(rope))
    with pytest.raises(ValueError, match=r"^model.reference_path: .*nowhere.*config.json"):
        check(str(tmp_path / "nowhere"))
    check(str(chat_model_dir()))


def test_a_resume_refuses_a_model_directory_whose_tokenizer_or_template_changed(straight, tmp_path,
                                                                                caplog):
    """A resume read the tokenizer and chat template of the run's model directory by path,
    unchecked: edited between the stop and the resume (or the directory rebuilt), the run went
    on rendering and tokenising its prompts otherwise. They are compared with the chosen step's
    hf/ copies, before any weights load; sampling.chat_template_path is the one accepted
    difference (the directory's template is then not read). A checkpoint that records no KL
    reference digest (the straight run trained without KL) resumes with the KL loss, warned,
    and records the reference from then on."""
    import shutil

    run = shutil.copytree(straight[0], tmp_path / "run")
    md = shutil.copytree(chat_model_dir(), tmp_path / "model")
    template = md / "chat_template.jinja"
    kept = tmp_path / "kept.jinja"
    shutil.copyfile(template, kept)
    template.write_text(kept.read_text() + "{# edited by hand #}")
    saved = run / "checkpoints/3/hf"
    with pytest.raises(ResumeError, match=rf"^resume refused: {re.escape(str(template))} differs "
                                          rf"from {re.escape(str(saved / 'chat_template.jinja'))}, "
                                          r".*\(model.path .*or set sampling.chat_template_path"):
        Trainer(_cfg(), run, md, resume=True)
    config = md / "tokenizer_config.json"
    config.write_text(json.dumps(dict(json.loads(config.read_text()), edited=True)))
    override = {"sampling.chat_template_path": str(kept)}
    with pytest.raises(ResumeError, match=rf"^resume refused: {re.escape(str(config))} differs"):
        Trainer(_cfg(**override), run, md, resume=True)   # the override covers the template only
    shutil.copyfile(saved / "tokenizer_config.json", config)
    with caplog.at_level("WARNING"):
        trainer = Trainer(_cfg(**override, **{"loss.use_kl_loss": "true"}), run, md, resume=True)
    try:
        assert trainer.chat.template_source == str(kept)
        assert "records no digest of the KL reference's weights" in caplog.text
        recorded = trainer._train_state_json()["kl_reference"]
    finally:
        trainer.close()
    assert recorded["path"] is None and re.fullmatch(r"[0-9a-f]{64}", recorded["weights_digest"])


def test_a_resume_refuses_kl_reference_weights_other_than_the_run_trained_against(tmp_path):
    """With the KL loss and no model.reference_path, a resume re-reads the initial policy from
    the run's model directory: weights rewritten there between the stop and the resume (same
    names, shapes and size) became the reference unnoticed. The fresh start records their
    sampled digest in the train state; the resume compares it before any array is read."""
    import shutil

    from safetensors.numpy import load_file, save_file

    md = shutil.copytree(chat_model_dir(), tmp_path / "model")
    kl = {"loss.use_kl_loss": "true", "loss.kl_coef": 1.0}
    trainer = Trainer(_cfg(**kl), tmp_path / "run", md)
    try:
        step = trainer.save()    # step 0: what the fresh start records
    finally:
        trainer.close()
    recorded = read_train_state(step)["kl_reference"]
    assert recorded["path"] is None and re.fullmatch(r"[0-9a-f]{64}", recorded["weights_digest"])
    weights = md / "model.safetensors"
    size = weights.stat().st_size
    save_file({k: v * 2 for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    assert weights.stat().st_size == size    # another fine-tune of the same model
    with pytest.raises(ResumeError, match=rf"^resume refused: the KL reference's weights in "
                                          rf"{re.escape(str(md))} \(model.path\) are not those"):
        Trainer(_cfg(**kl), tmp_path / "run", md, resume=True)


def test_a_log_write_that_fails_on_process_0_fails_every_process(monkeypatch):
    """Process 0 alone writes metrics.jsonl, trajectories and reports; when that failed (a full
    disk), the other processes went on into the next collective and waited for process 0 until
    JAX's heartbeat ended them without the reason. This process plays process 1."""
    import jscenegen.grpo.train.trainer as trainer_mod
    import jscenegen.sharding.mesh as mesh_mod

    monkeypatch.setattr(mesh_mod, "is_primary", lambda: False)
    monkeypatch.setattr(mesh_mod, "bytes_from_primary",
                        lambda data: b"[Errno 28] No space left on device: 'metrics.jsonl'")
    written = []
    with pytest.raises(OSError, match=r"^\[Errno 28\] No space left on device: 'metrics.jsonl'$"):
        trainer_mod._write_on_primary(lambda: written.append(1))
    assert written == []                         # process 0's work only


def test_the_policy_takes_the_tokenizers_pad_token_and_warns_of_dynamic_rope_past_its_positions(
        tmp_path, caplog):
    """VERL's actor sets the model config's pad_token_id from its tokenizer: the policy's
    embedding passes no lookup gradient to `<|endoftext|>`'s row although config.json names no
    pad token (the model's own loss test: test_model_qwen). A config.json with dynamic RoPE and
    max_position_embeddings 512, below sampling.max_episode_tokens 2560, warns once, naming
    the file and both lengths (recomputed log-probs would drift from the rollout's)."""
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(chat_model_dir(), model_dir)
    doc = json.loads((model_dir / "config.json").read_text())
    assert "pad_token_id" not in doc
    doc.update(max_position_embeddings=512, rope_scaling={"rope_type": "dynamic", "factor": 8.0})
    (model_dir / "config.json").write_text(json.dumps(doc))
    with caplog.at_level("WARNING", logger="jscenegen.model.rope"):
        trainer = Trainer(_cfg(**{"model.path": str(model_dir)}), tmp_path / "run", model_dir)
    trainer.close()
    tokenizer = trainer.chat.tokenizer
    assert tokenizer.pad_token == "<|endoftext|>"
    assert trainer.model.model.embed_tokens.pad_id == tokenizer.pad_token_id == trainer.arch.pad_token_id
    warned = [m for m in caplog.messages if "rope_type dynamic" in m]
    assert len(warned) == 1 and warned[0].startswith(
        f"{model_dir}/config.json: rope_type dynamic with max_position_embeddings 512, and "
        "sampling.max_episode_tokens is 2560: an episode past 512 tokens gets other RoPE "
        "frequencies in the trainer's recomputed log-probs"), warned


def test_every_process_compares_what_it_read_from_its_own_disk(tmp_path, monkeypatch):
    """The processes compared their config keys only: a host with an older scene set, other
    prompt files or another model architecture read from its own disk played other episodes in
    one batch. This process plays one of two, its digests shown to `check_same_settings`."""
    import jscenegen.grpo.train.trainer as trainer_mod
    from jscenegen.scene.sceneset import scene_set_hash

    given = []
    monkeypatch.setattr(trainer_mod, "check_same_settings", lambda d, advice: given.append((d, advice)))
    trainer = Trainer(_cfg(), tmp_path, chat_model_dir())
    trainer.close()
    ((nothing, advice),) = given
    assert nothing == {} and "the same files" in advice          # one process: nothing to compare
    monkeypatch.setattr(trainer_mod.jax, "process_count", lambda: 2)
    digests = trainer._input_digests(resume=False)
    resumed = trainer._input_digests(resume=True)   # the checkpoint's files: CheckpointStore's
    # a resume compares each host's tokenizer files with the checkpoint's on that host alone
    # (`check_same_tokenizer`): a host whose tokenizer_config.json differs in a field that
    # changes no token (model_max_length) was refused there alone, the others waiting in the
    # restore; its bytes now differ here, so every process refuses
    files = "copy of the tokenizer files (model.path's tokenizer, chat template and generation config files)"
    other = Path(shutil.copytree(trainer.model_dir, tmp_path / "hostB"))
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps(dict(config, model_max_length=4096)))
    trainer.model_dir = other
    host_b = trainer._input_digests(resume=True)
    (other / "chat_template.jinja").write_text("{{ messages }}")    # not read with an override
    trainer.cfg = trainer.cfg.model_copy(update={"sampling": trainer.cfg.sampling.model_copy(
        update={"chat_template_path": str(chat_model_dir() / "chat_template.jinja")})})
    overridden = trainer._input_digests(resume=True)
    (other / "chat_template.jinja").unlink()
    assert trainer._input_digests(resume=True) == overridden
    (other / "tokenizer_config.json").unlink()                     # absent: compared too
    absent = trainer._input_digests(resume=True)
    # with the KL loss and no model.reference_path, the cross-host check and the train state's
    # record of the reference read one directory: its weights are hashed once (were twice)
    hashed = []
    monkeypatch.setattr(trainer_mod, "weights_digest", lambda d: hashed.append(d) or "0" * 64)
    trainer.model_dir, trainer._weights_digests = chat_model_dir(), {}
    trainer.cfg = trainer.cfg.model_copy(update={"loss": trainer.cfg.loss.model_copy(
        update={"use_kl_loss": True})})
    with_kl = trainer._input_digests(resume=False)
    assert trainer._reference_record() == {"path": None, "weights_digest": "0" * 64}
    assert hashed == [chat_model_dir()]
    monkeypatch.undo()
    assert with_kl["KL reference's weights (model.reference_path, else model.path)"] == "0" * 64
    assert [k for k in resumed if resumed[k] != host_b[k]] == [files]
    assert [k for k in absent if absent[k] != overridden[k]] == [files]
    assert set(digests) - set(resumed) == {"initial policy's weights (model.path)"}
    assert sorted(digests) == [files, "dev scene set (the file's scenes)",
                               "initial policy's weights (model.path)",
                               "model architecture (config.json)",
                               "scene protocol (prompt files, catalogue, rules, judge)",
                               "tokenizer or chat template", "train scene set (the file's scenes)"]
    assert digests["train scene set (the file's scenes)"] == scene_set_hash(trainer.scenes)
    assert digests["scene protocol (prompt files, catalogue, rules, judge)"] == trainer.protocol_hash
    assert all(re.fullmatch(r"[0-9a-f]{64}", v) for v in digests.values()), digests


def test_a_hosts_first_signal_waits_for_the_update_after_another_hosts_stop_was_agreed(
        monkeypatch, caplog):
    """A stop agreed from another host's signal was read as this host's first signal, so this
    host's own first SIGTERM (scancel signals every host, moments apart) unwound it at once,
    inside the collective final save its peers were in."""
    from types import SimpleNamespace

    import jscenegen.grpo.train.trainer as trainer_mod
    from jscenegen.signals import Terminated

    monkeypatch.setattr(trainer_mod, "raise_if_redelivered", lambda signum: None)
    monkeypatch.setattr(trainer_mod.STOP_REQUESTS, "take", lambda signum: 1)
    monkeypatch.setattr(trainer_mod, "max_over_processes", lambda value: signal.SIGTERM)
    host = SimpleNamespace(_signal_received=None, _stop_signal=None)
    assert Trainer._stop_agreed(host) and host._stop_signal == signal.SIGTERM   # another host's
    assert host._signal_received is None
    with caplog.at_level("WARNING"):
        Trainer._on_signal(host, signal.SIGTERM, None)         # its own first: waits
    assert host._signal_received == signal.SIGTERM
    assert any("stopping after the current update" in m for m in caplog.messages)
    with pytest.raises(Terminated):
        Trainer._on_signal(host, signal.SIGTERM, None)         # its own second: at once


@pytest.mark.parametrize("in_one_call", [False, True])
def test_a_second_signal_stops_the_run_at_once_keeping_the_saved_checkpoints(
        tmp_path, caplog, monkeypatch, in_one_call):
    """The first SIGTERM asks for a stop after the current update; a second one (a user who
    will not wait for a long update) unwinds at once: no new checkpoint, the saved ones kept.
    Sent while the main thread is in one native call, both requests reach one handler
    call, which counts them as two (it counted one and waited for the update to end)."""
    from jscenegen.signals import REPEAT_WINDOW_S, STOP_REQUESTS, Terminated

    monkeypatch.setattr(STOP_REQUESTS, "exit_untaken_s", 600.0)   # the handler takes them
    # rows a start that stopped before its first checkpoint left: dropped by this fresh start
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"attempt": 0, "stale": True}) + "\n")
    trainer = Trainer(_cfg(), tmp_path, chat_model_dir())   # saves every update
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    before = signal.getsignal(signal.SIGTERM)
    plan = (0.2, 0.0, REPEAT_WINDOW_S + 0.1)   # a request, `timeout`'s repeat, a second request
    sent = []

    def send():
        for delay in plan:
            time.sleep(delay)
            sent.append(signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)

    def progress(row):
        if row["attempt"] != 1:       # after the second update (the first one was saved)
            return
        if not in_one_call:
            send()
            return
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})   # delivered elsewhere
        try:
            sender = threading.Thread(target=send, daemon=True)
            sender.start()
            time.sleep(sum(plan) + 0.6)    # one C call: the signals come while it runs
            assert not sender.is_alive()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})

    try:
        with pytest.raises(Terminated):
            trainer.run(5, progress=progress)
    finally:
        trainer.close()
    assert len(sent) == len(plan)
    expected = ("two stop requests arrived during one native call" if in_one_call
                else "SIGTERM: stopping after the current update")
    assert expected in caplog.text
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]
    assert check_step(tmp_path / "checkpoints" / "1").valid
    assert signal.getsignal(signal.SIGTERM) is before   # the run's handler is gone


def test_a_signal_during_a_save_stops_the_run_after_that_save(tmp_path, monkeypatch):
    """The stop request was read only right after an update: a SIGTERM that arrived while the
    checkpoint was written ran one more whole update (rollout and step) before stopping."""
    real = Trainer.save

    def save(self):
        out = real(self)
        if self.pos.attempts == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(Trainer, "save", save)
    _, summary = _run(tmp_path)
    assert summary.stopped_by_signal == "SIGTERM" and summary.attempts == 1
    assert CheckpointStore(tmp_path / "checkpoints").steps() == [1]


def test_a_signal_on_another_process_during_the_last_save_is_reported_on_this_one(tmp_path,
                                                                                monkeypatch):
    """A stop signal that reached a peer process during the run's last save (after the last
    agreement inside the loop) made that process alone report the stop, skip the evaluation
    after training (collectives) and exit 143, its peers waiting for it in that evaluation. The
    peer is this process's `max_over_processes` answering SIGTERM from its fourth call on."""
    import jscenegen.grpo.train.trainer as trainer_module

    calls = []

    def peers_max(value):
        calls.append(value)
        return int(signal.SIGTERM) if len(calls) >= 4 else value

    monkeypatch.setattr(trainer_module, "max_over_processes", peers_max)
    _, summary = _run(tmp_path, max_updates=1, **{"checkpoint.save_every": 1})
    # whether an evaluation is owed, two agreements in the loop's iteration, one after the
    # last save, one after the handlers went back
    assert len(calls) == 5
    assert summary.stopped_by_signal == "SIGTERM" and summary.attempts == 1


def test_a_corrupt_newest_checkpoint_is_set_aside_and_the_run_goes_on(straight, tmp_path, caplog):
    """A flipped byte in the newest step: resume sets it aside (naming the file), redoes its
    update from the step before (bitwise as the straight run), saves that step again, trains
    past it, and resumes again."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(straight[0], run_dir)
    victim = max((p for p in (run_dir / "checkpoints/3/params").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    rel = victim.relative_to(run_dir / "checkpoints/3").as_posix()
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with caplog.at_level("WARNING"):
        _, redo = _run(run_dir, resume=True)
    (aside,) = (run_dir / "checkpoints").glob("3.corrupt-*")
    assert f"{rel}: SHA-256 differs" in caplog.text and "set aside" in caplog.text
    assert (aside / rel).read_bytes() == bytes(data)  # kept as it was, for inspection
    assert redo.attempts == 3 and check_step(run_dir / "checkpoints/3").valid
    a, b = _final(straight[0]), _final(run_dir)
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name], err_msg=name)
    assert _metrics(run_dir) == _metrics(straight[0])
    _, more = _run(run_dir, resume=True, **{"schedule.total_updates": 4})
    assert more.attempts == 4 and _final(run_dir).step == 4
    caplog.clear()
    with caplog.at_level("WARNING"):   # a finished run: said so, nothing redone or overwritten
        _, again = _run(run_dir, resume=True, **{"schedule.total_updates": 4})
    assert again.attempts == 4 and again.checkpoint == str(run_dir / "checkpoints" / "4")
    assert "already finished its schedule (4 of 4 effective updates" in caplog.text
    assert aside.is_dir()  # keep-last-k never deletes a set-aside step


def test_resume_refuses_a_changed_schedule_prefix_or_reward(straight, tmp_path_factory, caplog, monkeypatch):
    import shutil

    run_dir = tmp_path_factory.mktemp("copy") / "run"
    shutil.copytree(straight[0], run_dir)
    # the setting that changed is named (it listed the four candidates: "the schedule's first
    # 3 scenes or their seeds (schedule.train_set), schedule.roles, schedule.group_size or
    # schedule.seed changed"), as the protocol and reward refusals name theirs
    saved_hash = read_train_state(run_dir / "checkpoints/3")["schedule_hash"]
    with pytest.raises(ResumeError) as info:
        Trainer(_cfg(**{"schedule.group_size": 4}), run_dir, chat_model_dir(), resume=True)
    assert re.fullmatch(r"resume refused: the schedule changed: schedule\.group_size 2 -> 4 "
                        rf"\(checkpoint schedule_hash {saved_hash}, now (?!{saved_hash})[0-9a-f]{{64}}\)",
                        str(info.value)), str(info.value)
    with pytest.raises(ResumeError, match=r"^resume refused: the schedule changed: schedule.roles "
                                          r"'PPC' -> 'DDDPC'; schedule.seed 0 -> 5 \(checkpoint "
                                          r"schedule_hash [0-9a-f]{64}, now [0-9a-f]{64}\)$"):
        Trainer(_cfg(**{"schedule.roles": "DDDPC", "schedule.seed": 5}), run_dir, chat_model_dir(),
                resume=True)
    # the reward is part of the protocol too: the key that changed is named
    with pytest.raises(ResumeError, match=r"reward configuration changed \(scene.reward.unit_penalty: "
                                          r"[0-9.e-]+ in the checkpoint, now 0.5\)$"):
        Trainer(_cfg(**{"scene.reward.unit_penalty": 0.5}), run_dir, chat_model_dir(), resume=True)
    with pytest.raises(ResumeError, match=r"the scene protocol changed \(scene.max_objects 40 -> 7; "
                                          r"checkpoint protocol hash [0-9a-f]{16}, now [0-9a-f]{16}\)$"):
        Trainer(_cfg(**{"scene.max_objects": 7}), run_dir, chat_model_dir(), resume=True)
    monkeypatch.setattr("jscenegen.scene.protocol.RULES_REVISION", -1)   # same settings, other rules
    with pytest.raises(ResumeError, match=r"no scene or judge setting did: .*RULES_REVISION"):
        # a judge setting outside the hash (the rule judge's timeout) is not blamed
        Trainer(_cfg(**{"judge.timeout_s": 7.0}), run_dir, chat_model_dir(), resume=True)
    monkeypatch.undo()
    with pytest.raises(ResumeError, match="already holds checkpoints"):
        Trainer(_cfg(), run_dir, chat_model_dir(), resume=False)
    # not refused (the LR schedule is the optimizer's), but a cosine shorter than the run
    # would climb back up past its end
    with caplog.at_level("WARNING"):
        Trainer(_cfg(**{"optim.lr_schedule": "cosine", "optim.total_steps": 2}), run_dir,
                chat_model_dir(), resume=True).close()
    assert "optim.total_steps=2 is below schedule.total_updates=3" in caplog.text


def test_a_resume_checks_its_evaluation_files_before_the_model_loads(straight, tmp_path_factory,
                                                                     capsys, monkeypatch):
    """A resume found an unreadable eval_before.json only after its eval_after evaluation,
    then warned and deleted the last start's eval_change.* (the only intact record of the
    before numbers); a directory at eval_after.json failed only after that evaluation too.
    Both are refused now before the trainer (and the model) is made, naming the file."""
    import shutil

    import yaml

    import jscenegen.grpo.train.trainer as trainer_module
    from jscenegen.cli import main

    run_dir = tmp_path_factory.mktemp("evalfiles") / "run"
    shutil.copytree(straight[0], run_dir)
    assert _cfg().trainer.eval_before_after   # the CPU default's
    (run_dir / "config.yaml").write_text(yaml.safe_dump(_cfg().model_dump(mode="json")))

    def no_model(*args, **kwargs):
        raise AssertionError("the trainer was made")
    monkeypatch.setattr(trainer_module.Trainer, "__init__", no_model)
    (run_dir / "eval_before.json").write_text("{garbage")
    (run_dir / "eval_change.json").write_text('{"diff": 0.326}')
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run_dir / 'eval_before.json'}: not valid JSON") and err.endswith(
        "; the resumed run compares its eval_after with this report (eval_change.json): restore it, "
        "or move it away to resume without the comparison\n"), err
    assert (run_dir / "eval_change.json").read_text() == '{"diff": 0.326}'   # kept
    (run_dir / "eval_before.json").unlink()
    (run_dir / "eval_after.json").mkdir()
    assert main(["train", "--resume", str(run_dir)]) == 2
    assert capsys.readouterr().err == (
        f"error: {run_dir / 'eval_after.json'}: is a directory; the run writes its eval_after "
        "evaluation there (move it away, or set trainer.eval_before_after=false)\n")


def test_a_refused_resume_does_not_say_its_overrides_change_anything(straight, tmp_path_factory,
                                                                    capsys, caplog):
    """`train --resume RUN key=value` warned "resume changes ..." and then refused the resume:
    the notice now comes once the trainer has accepted it."""
    import shutil

    import yaml

    from jscenegen.cli import main

    run_dir = tmp_path_factory.mktemp("refused") / "run"
    shutil.copytree(straight[0], run_dir)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(_cfg().model_dump(mode="json")))
    with caplog.at_level("WARNING"):
        assert main(["train", "--resume", str(run_dir), "schedule.roles=DDDPC"]) == 2
    err = capsys.readouterr().err
    assert "the schedule changed: schedule.roles 'PPC' -> 'DDDPC' (checkpoint" in err
    assert "changes" not in caplog.text and "changes" not in err
    with caplog.at_level("WARNING"):    # accepted (the run has finished its schedule: no step)
        assert main(["train", "--resume", str(run_dir), "optim.lr=0.002"]) == 0
    assert "resume changes optim.lr 0.001 -> 0.002" in caplog.messages


def test_scenes_whose_episodes_cannot_take_a_turn_are_refused_before_the_weights(tmp_path):
    """With the prompts over sampling.max_episode_tokens every episode failed with
    episode_token_cap, and the run made its attempts without a word (eval and design refuse
    the same case up front)."""
    with pytest.raises(ValueError, match=r"train.jsonl: train_\d+: the prompt \(\d+ tokens\) makes the "
                       r"episode start at \d+ tokens .* sampling.max_episode_tokens=128; .* \(all 3 of "
                       r"the first 3 scene\(s\) that start do: no episode could take a turn\)"):
        Trainer(_cfg(**{"sampling.max_episode_tokens": 128}), tmp_path / "run", chat_model_dir())
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_run_ended_by_its_attempt_cap_says_so_and_names_the_cap(tmp_path, caplog):
    """A run whose attempts never stepped ended at schedule.max_attempts with rc 0 and no word;
    its resume then advised raising total_updates, which cannot help."""
    cap = {"schedule.zero_spread": "skip", "schedule.max_attempts": 2}   # no reward spread: no step
    with caplog.at_level("WARNING"):
        _, summary = _run(tmp_path, **cap)
    assert summary.attempts == 2 and summary.effective_updates == 0
    assert "stopped at schedule.max_attempts=2 attempts with 0 of 3 effective updates" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        _run(tmp_path, resume=True, **cap)
    assert "already finished its schedule (0 of 3 effective updates, 2 attempts); raise " \
           "schedule.max_attempts to extend it" in caplog.text


def test_a_run_without_a_model_directory_resumes_past_its_first_steps_deletion(straight, tmp_path,
                                                                             capsys):
    """A converted run (checkpoints only, no run.json) took the newest step's hf/ as its model
    directory; once `keep_last` newer steps replaced that step, the next save found no
    config.json and the run crashed, and so did every later resume. The resume now copies the
    assets to RUN/hf_assets once and records it in run.json."""
    import shutil

    from jscenegen.checkpoint.checksums import write_checksums
    from jscenegen.checkpoint.resume import CONVERTED_MANIFEST
    from jscenegen.cli import main
    from jscenegen.run_files import RUN_ASSETS

    run = tmp_path / "run"
    shutil.copytree(straight[0] / "checkpoints", run / "checkpoints")   # steps 2 and 3
    write_checksums(run / "checkpoints")    # as `convert --to orbax` leaves its output
    overrides = [o for o in _OVERRIDES if not o.startswith("schedule.total_updates=")]
    assert main(["train", "--resume", str(run), "--config", "configs/cpu-default.yaml", *overrides,
                 "schedule.total_updates=6", "trainer.eval_before_after=false"]) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["5", "6"]
    assert json.loads((run / "run.json").read_text())["model_dir"] == RUN_ASSETS   # the run's own
    assert (run / RUN_ASSETS / "config.json").read_bytes() == \
        (straight[0] / "checkpoints/3/hf/config.json").read_bytes()
    # the converter's manifest named steps 2 and 3, deleted since: retired, so the run verifies
    assert (run / "checkpoints" / CONVERTED_MANIFEST).is_file()
    assert not (run / "checkpoints/checksums.json").exists()
    capsys.readouterr()
    assert main(["convert", "--verify", str(run)]) == 0
    assert capsys.readouterr().out.startswith(f"{run}: steps 5, 6: ")
    assert main(["convert", "--inspect", str(run)]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == [5, 6]
    copy = shutil.copytree(run, tmp_path / "copy")   # a copy of the run reads its own assets
    assert main(["train", "--resume", str(copy), "schedule.total_updates=7"]) == 0
    assert _final(copy).step == 7


def test_an_exported_step_converted_back_resumes_as_the_same_run(straight, tmp_path, capsys):
    """export -> `convert --from verl --to orbax` kept weights and moments but dropped the run's
    identity: the resume took any schedule and restarted its position from the global step.
    The trainer's train state now travels beside the VERL rank files: the converted step
    resumes exactly as the original (bitwise) and refuses a changed schedule; a state file
    naming another step (VERL trained on) is ignored with a warning, a malformed one named."""
    import shutil

    from convert.dispatch import convert, verify_source
    from convert.errors import ConversionWarning, ConvertError
    from convert.inspect import describe
    from convert.orbax_directions import verl_to_orbax
    from jscenegen.checkpoint.checksums import verify_checksums, write_checksums
    from jscenegen.checkpoint.resume import RUN_STATE_FILE
    from jscenegen.cli import main

    original = read_train_state(straight[0] / "checkpoints/3")
    assert main(["export", str(straight[0]), str(tmp_path / "pub"),   # the run: its newest step
                 "--world-size", "2", "--mesh-device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith(f"exported {straight[0] / 'checkpoints/3'} -> ")
    shard = tmp_path / "pub/training_state/global_step_3"
    assert verify_checksums(tmp_path / "pub") > 0
    assert json.loads((shard / RUN_STATE_FILE).read_text()) == original
    (described,) = describe(tmp_path / "pub")["training_state"]
    assert described["run_identity"] == {"attempts": 3, "effective_updates": 3,
                                         "schedule_hash": original["schedule_hash"],
                                         "protocol_hash": original["protocol_hash"]}
    assert main(["convert", str(shard), str(tmp_path / "back/checkpoints"),
                 "--from", "verl", "--to", "orbax"]) == 0
    back = read_train_state(tmp_path / "back/checkpoints/3")
    assert back == {**original, "source_format": "verl"}
    meta = json.loads((tmp_path / "back/checkpoints/3/training_metadata.json").read_text())
    assert meta["schedule_hash"] == original["schedule_hash"] and meta["effective_updates"] == 3
    # converted from VERL files, the step records no config to name the setting from
    with pytest.raises(ResumeError, match="schedule.roles, schedule.group_size or schedule.seed"):
        Trainer(_cfg(**{"schedule.roles": "DDDPC"}), tmp_path / "back", chat_model_dir(), resume=True)
    with pytest.raises(ResumeError, match="the scene protocol changed"):
        Trainer(_cfg(**{"scene.max_objects": 7}), tmp_path / "back", chat_model_dir(), resume=True)
    reference = shutil.copytree(straight[0], tmp_path / "reference")
    extend = {"schedule.total_updates": 4}
    _, a = _run(reference, resume=True, **extend)
    _, b = _run(tmp_path / "back", resume=True, **extend)
    assert a.attempts == b.attempts == 4
    fa, fb = _final(reference), _final(tmp_path / "back")
    assert fa.train_state == fb.train_state and fb.train_state["lr_step"] == 4
    for name in fa.params:
        np.testing.assert_array_equal(fa.params[name], fb.params[name], err_msg=name)
        np.testing.assert_array_equal(fa.adam["nu"][name], fb.adam["nu"][name], err_msg=name)

    copy = shutil.copytree(tmp_path / "pub", tmp_path / "edited", symlinks=True)
    moved = copy / "training_state/global_step_3"
    (moved / RUN_STATE_FILE).write_text(json.dumps(dict(original, lr_step=2)))
    with pytest.raises(ConvertError, match=rf"{RUN_STATE_FILE}: \d+ bytes, expected"):
        verify_source(moved)   # the export's checksums cover it (`convert` checks them first)
    write_checksums(copy)
    with pytest.warns(ConversionWarning, match=rf"{RUN_STATE_FILE}: names step 3 \(LR count 2\), "
                                               r"not this checkpoint's 3 \(3\); ignored"):
        verl_to_orbax(moved, tmp_path / "plain")
    assert "schedule" not in read_train_state(tmp_path / "plain/3")
    for edit, why in (({"schedule": {}}, "not a jscenegen train state"),
                      ({"reward": 5}, "reward: Input should be a valid dictionary"),
                      ({"schedule": {"attempts": 3}}, "schedule.scene_index: missing"),
                      ({"num_scenes": "x"}, r'num_scenes: Input should be a valid integer \(got "x"\)'),
                      ({"lr_step": 3.5}, "lr_step: Input should be a valid integer")):
        (moved / RUN_STATE_FILE).write_text(json.dumps(edit if "not a" in why else {**original, **edit}))
        write_checksums(copy)
        with pytest.raises(ConvertError, match=rf"{RUN_STATE_FILE}: {why}"):
            verl_to_orbax(moved, tmp_path / "bad")
        assert not (tmp_path / "bad").exists()
    (moved / RUN_STATE_FILE).unlink()
    (moved / RUN_STATE_FILE).mkdir()
    with pytest.raises(ConvertError, match=rf"{RUN_STATE_FILE}: not a regular file"):
        verl_to_orbax(moved, tmp_path / "bad")
    # a VERL -> VERL reshard keeps it (it dropped it: converted back, the identity was gone)
    convert(shard, tmp_path / "w3", src_format="verl", dst_format="verl", world_size=3,
            mesh_device="cpu")
    (w3,) = (tmp_path / "w3").glob(f"global_step_3/actor/{RUN_STATE_FILE}")
    assert json.loads(w3.read_text()) == original


def test_a_step_that_is_a_link_or_a_file_is_refused_before_the_first_update(straight, tmp_path):
    """A symlinked step failed keep_last's delete after the run's last save (rc 2, no path
    named); a file named like the next step failed that step's save after its update ran."""
    import shutil

    from jscenegen.checkpoint.store import CheckpointError

    run = shutil.copytree(straight[0], tmp_path / "run")
    shutil.move(run / "checkpoints/3", tmp_path / "elsewhere")
    (run / "checkpoints/3").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match=rf"^{run / 'checkpoints/3'}: a symbolic link, named "
                                              r"like a checkpoint step \(1 such entry\)"):
        Trainer(_cfg(), run, chat_model_dir(), resume=True)
    (run / "checkpoints/3").unlink()
    shutil.move(tmp_path / "elsewhere", run / "checkpoints/3")
    (run / "checkpoints/7").write_text("junk")
    with pytest.raises(CheckpointError, match=rf"^{run / 'checkpoints/7'}: not a directory"):
        Trainer(_cfg(), run, chat_model_dir(), resume=True)
    assert not check_step(run / "checkpoints/7").valid
    assert check_step(run / "checkpoints/7").reason.endswith("is not a directory")


def test_a_step_directory_copied_under_another_number_is_refused(straight, tmp_path, monkeypatch):
    """`cp -r checkpoints/3 checkpoints/7` resumed step 7 at attempt 3, and a later save failed
    far from the cause; it is refused before the step's arrays are restored (its files are
    still hashed first, as every resume hashes them; a copied step of a large model was refused
    only after its restore onto the devices)."""
    import shutil

    from jscenegen.checkpoint.store import CheckpointError, CheckpointStore

    run = shutil.copytree(straight[0], tmp_path / "run")
    shutil.copytree(run / "checkpoints/3", run / "checkpoints/7")
    restored = []
    real = CheckpointStore.restore
    monkeypatch.setattr(CheckpointStore, "restore",
                        lambda self, *a, **k: (restored.append(a), real(self, *a, **k))[1])
    with pytest.raises(CheckpointError, match=rf"^{run / 'checkpoints/7'}: a step directory "
                                              r"numbered 7 whose train_state schedule\.attempts is 3;"):
        Trainer(_cfg(), run, chat_model_dir(), resume=True)
    assert restored == []


def test_an_update_runs_no_separate_old_logprob_forward(tmp_path):
    """One mini-batch, one epoch: the loss pass's own log-probs are the old ones (ratio exactly
    1); the trainer ran a separately compiled forward for them before every step."""
    trainer = Trainer(_cfg(), tmp_path, chat_model_dir())
    calls = []
    real = trainer.step_fn.logprobs
    trainer.step_fn.logprobs = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        summary = trainer.run(1)
    finally:
        trainer.close()
    assert summary.optimizer_steps == 1 and calls == []


def test_the_trainers_sum_norm_horizon_is_constant_unless_configured():
    """The batch's padded T moves with the longest episode; VERL divides by its fixed response
    length, so the trainer fixes an unset horizon at the episode cap."""
    sum_norm = {"loss.loss_agg_mode": "seq-mean-token-sum-norm"}
    assert constant_horizon(_cfg(**sum_norm)).horizon == 2560
    assert constant_horizon(_cfg(**sum_norm, **{"loss.horizon": 700})).horizon == 700
    assert constant_horizon(_cfg()).horizon is None      # token-mean: no horizon


@pytest.mark.parametrize("layout", ["auto", "fsdp"])
def test_a_non_finite_gradient_is_no_effective_update_and_its_role_waits(tmp_path, monkeypatch,
                                                                        caplog, layout):
    """The second attempt's advantages are NaN in trained positions: the step is skipped
    (parameters and Adam state kept), so it is not an effective update and the role schedule
    does not move on. The sampler is given the step's output all the same: the step donated
    its input, and under `rollout.layout=fsdp` (fp32 weights and compute: no cast) the sampler
    reads the training arrays themselves, so without it attempt 3 decoded deleted buffers
    (XLA's "Buffer has been deleted or donated", then SIGSEGV). Under `auto` the run stops
    after the skipped step and resumes: the skipped-step count and the LR-scheduler count
    (which advanced on the skipped step) are restored."""
    import jscenegen.grpo.train.trainer as trainer_module
    from jscenegen.grpo.rollout.engine import RolloutEngine

    calls = []
    real = trainer_module.shard_batch

    def poisoned(arrays, mesh):
        calls.append(1)
        if len(calls) == 2:
            arrays = dict(arrays, advantages=np.where(arrays["loss_mask"] > 0, np.nan,
                                                      arrays["advantages"]).astype(np.float32))
        return real(arrays, mesh)

    deleted = []
    real_run_groups = RolloutEngine.run_groups

    def run_groups(self, *args, **kwargs):   # a clean failure where decoding would crash
        deleted.append(sum(a.is_deleted() for a in jax.tree.leaves(self.sampler.state)))
        assert deleted[-1] == 0, f"rollout {len(deleted)}: the sampler holds deleted arrays"
        return real_run_groups(self, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "shard_batch", poisoned)
    monkeypatch.setattr(RolloutEngine, "run_groups", run_groups)
    over = {"checkpoint.save_every": 10, "rollout.layout": layout}
    if layout == "fsdp":   # one process: attempt 3 decodes with what the skipped step left
        _, summary = _run(tmp_path, max_updates=3, **over)
    else:
        _, first = _run(tmp_path, max_updates=2, **over)
        assert first.attempts == 2
        assert read_train_state(Path(first.checkpoint))["skipped_steps"] == 1
        _, summary = _run(tmp_path, resume=True, max_updates=1, **over)
    assert deleted == [0, 0, 0]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/skipped"] for r in rows] == [0, 1, 0]
    assert [r["stepped"] for r in rows] == [True, False, True]
    assert [r["effective_updates"] for r in rows] == [1, 1, 2]
    assert [r["role"] for r in rows] == ["planner", "planner", "planner"]   # PPC: P, (P), P
    assert [r["masked_rate"] for r in rows] == [0.0, 0.0, 0.0]   # attempt 3 rolled out whole
    # a reshard after every step, the skipped one's too: the whole fp32 weights on each of the
    # six devices (replicated), or nothing under fsdp (the training arrays, no copy)
    n_params = sum(int(np.prod(s)) for s in param_shapes(QwenConfig.from_dir(chat_model_dir())).values())
    per_step = {"auto": 6 * 4 * n_params, "fsdp": 0}[layout]
    assert [r["rollout/reshard_bytes"] for r in rows] == [per_step] * 3
    assert summary.effective_updates == 2
    ck = _final(tmp_path)
    assert int(ck.adam["count"]) == 2 and ck.train_state["skipped_steps"] == 1
    assert ck.train_state["lr_step"] == 3
    assert "the gradient is not finite" in caplog.text


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="unknown key 'optim.learning_rate'"):
        _cfg(**{"optim.learning_rate": 1})
    with pytest.raises(ConfigError, match="schedule.group_size"):
        _cfg(**{"schedule.group_size": "eight"})
    with pytest.raises(ConfigError, match=r"sampling\.temperature: Input should be greater than "
                                          r"or equal to 0\.00001"):
        _cfg(**{"sampling.temperature": 1e-40})   # logits / T would overflow to NaN
    from jscenegen.grpo.train.trainer import train_scenes

    with pytest.raises(ValueError, match=r"rollout\.groups_per_batch=4: more scenes per batch "
                                         r"than the schedule's 3"):
        train_scenes(_cfg(**{"rollout.groups_per_batch": 4}))
    with pytest.raises(ValueError, match=r"groups_per_batch=3 x schedule\.group_size=2000 "
                                         r"episodes per batch: at most 4096"):
        train_scenes(_cfg(**{"rollout.groups_per_batch": 3, "schedule.group_size": 2000}))
    from jscenegen.sharding.mesh import MeshError

    with pytest.raises(MeshError, match="mesh.fsdp=4 x mesh.sp=2 = 8 does not match the 6 devices"):
        Trainer(_cfg(**{"mesh.fsdp": 4}), "/tmp/never-written", chat_model_dir())


def test_groups_per_batch_trains_two_scenes_in_one_step(tmp_path):
    trainer, summary = _run(tmp_path, max_updates=1, **{"rollout.groups_per_batch": 2})
    assert summary.attempts == 1 and summary.optimizer_steps == 1
    row = _metrics(tmp_path)[0]
    assert row["episodes"] == 4 and row["rollout/batch_rows"] == 6 and row["trained_tokens"] > 0
    assert trainer.pos.scene_index == 2 and trainer.pos.effective_updates == 1


# ---- a Qwen3.5 policy: carried vision tower and mtp.* frozen, Adam only for what trains -----
def _run35(run_dir, **kw):
    from chat_fixtures import qwen35_chat_model_dir

    return _run(run_dir, model_dir=qwen35_chat_model_dir(), **{"schedule.total_updates": 2, **kw})


@pytest.fixture(scope="module")
def straight35(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight35")
    trainer, summary = _run35(run_dir)
    return run_dir, summary, trainer


@pytest.mark.slow   # three Qwen3.5 trainers, each tracing its steps: 60-80 s on 2 cores
def test_qwen35_sigterm_resume_extend_is_bitwise_and_carried_tensors_never_move(straight35, tmp_path):
    from jax.sharding import PartitionSpec as P

    from jscenegen.grpo.algo.optimizer import adam_state
    from jscenegen.model.config import QwenConfig
    from jscenegen.model.hf_io import iter_hf_tensors
    from jscenegen.model.weights import named_leaves, param_shapes

    from chat_fixtures import qwen35_chat_model_dir

    run_dir, summary, trainer = straight35
    assert summary.optimizer_steps == 2
    _, first = _run35(tmp_path, sigterm_after=1)
    assert first.stopped_by_signal and first.attempts == 1
    # the resume also extends the scene list (3 -> 4 scenes): the prefix's schedule hash holds
    _, second = _run35(tmp_path, resume=True, **{"schedule.num_scenes": 4})
    assert second.attempts == 2
    a, b = _final(run_dir), _final(tmp_path)
    assert (a.train_state["num_scenes"], b.train_state["num_scenes"]) == (3, 4)
    cfg = QwenConfig.from_dir(qwen35_chat_model_dir())
    every, trained = param_shapes(cfg, carried=True), param_shapes(cfg)
    assert set(a.params) == set(every) and set(a.adam["mu"]) == set(a.adam["nu"]) == set(trained)
    frozen = sorted(set(every) - set(trained))
    assert any(n.startswith("model.visual.") for n in frozen) and any(n.startswith("mtp.") for n in frozen)
    assert sorted(a.metadata["frozen_tensors"]) == frozen and sorted(a.frozen) == frozen
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name], err_msg=name)
    for name in trained:
        np.testing.assert_array_equal(a.adam["mu"][name], b.adam["mu"][name], err_msg=name)
        np.testing.assert_array_equal(a.adam["nu"][name], b.adam["nu"][name], err_msg=name)
    assert _metrics(run_dir) == _metrics(tmp_path)
    source = dict(iter_hf_tensors(qwen35_chat_model_dir(), cfg))
    for name in frozen:  # carried through two runs and a resume, bitwise, in their stored dtype
        assert a.params[name].dtype == source[name].dtype, name
        np.testing.assert_array_equal(a.params[name], source[name], err_msg=name)
    moved = [n for n in trained if not np.array_equal(a.params[n], source[n])]
    assert "model.language_model.layers.0.linear_attn.A_log" in moved  # the GDN trains
    # `jscenegen eval` builds the policy from the step (every tensor in params/)
    from jscenegen.eval.evaluate import load_policy
    from jscenegen.model.weights import Carried, named_weights
    from jscenegen.sharding.mesh import make_mesh

    policy = load_policy(run_dir / "checkpoints" / "2", make_mesh(3, 2))
    carried = {n for n, v in named_weights(policy).items() if isinstance(v, Carried)}
    assert carried == set(frozen)
    # the live state after the compiled steps: every moment FSDP2-sharded like its parameter
    st = adam_state(trainer.state.opt_state)
    for group in (named_leaves(st.mu), named_leaves(st.nu)):
        for name, arr in group.items():
            assert arr.sharding.spec == P(("fsdp", "sp")) and arr.shape[0] % 6 == 0, name


def test_run_logs_are_cut_back_to_the_resumed_attempt_and_a_torn_last_row_dropped(tmp_path, caplog):
    from jscenegen.grpo.train.metrics import truncate_run_logs

    rows = [json.dumps({"attempt": a, "x": a}) for a in (0, 1, 1, 2)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"attempt": 3, "tor')
    (tmp_path / "trajectories.jsonl").write_text("\n".join(rows) + "\n")
    with caplog.at_level("WARNING"):
        truncate_run_logs(tmp_path, 2)
    for name in ("metrics.jsonl", "trajectories.jsonl"):
        assert (tmp_path / name).read_text() == "\n".join(rows[:3]) + "\n", name
    assert caplog.messages == []
    # rows of attempts before the checkpoint lost (a file cut short, or deleted): said, not silent
    (tmp_path / "metrics.jsonl").write_text(rows[0] + "\n" + rows[3] + "\n")
    with caplog.at_level("WARNING"):
        truncate_run_logs(tmp_path, 3)
    assert caplog.messages == [f"{tmp_path / 'metrics.jsonl'} has no row for attempt(s) 1 of the 3 "
                               "before the checkpoint (lost or torn): the resumed log has a gap there"]
    caplog.clear()
    # a log that begins later (a run resumed from a converted step at attempt 2) has no gap
    (tmp_path / "metrics.jsonl").write_text(rows[3] + "\n")
    with caplog.at_level("WARNING"):
        truncate_run_logs(tmp_path, 3)
    assert caplog.messages == []
    # a run killed during an earlier cut-back left its temporary: removed, nothing else
    (tmp_path / ".metrics.jsonl.k1ll3d.tmp").write_text(rows[3] + "\n")
    (tmp_path / ".trajectories.jsonl.a2b3c4.tmp").write_text("")
    (tmp_path / ".metrics.jsonl.notes").write_text("mine")
    truncate_run_logs(tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".metrics.jsonl.notes", "metrics.jsonl",
                                                          "trajectories.jsonl"]
    (tmp_path / "metrics.jsonl").write_text('{"attempt": 0}\nnot json\n{"attempt": 1}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON row"):
        truncate_run_logs(tmp_path, 1)
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3   # left as it was


@pytest.mark.slow   # a run through several failing updates: ~10 s on 2 cores
def test_a_judge_that_fails_every_episode_stops_the_run_with_a_checkpoint(tmp_path, monkeypatch, capsys):
    """A judge that went down masked every episode, update after update, until max_attempts."""
    from types import SimpleNamespace

    from jscenegen.grpo.train.trainer import JudgeDownError

    def ep(cause):
        return SimpleNamespace(failure_cause=cause)

    fake = SimpleNamespace(_judge_down=[], _rollout_down=[], cfg=_cfg())
    for batch, down in [([ep("judge_timeout"), ep("bad_json")], 1),    # every judged one failed
                        ([ep("bad_json")], 1),                          # nothing judged: no news
                        ([ep("judge_error"), ep("judge_error")], 2),
                        ([ep("judge_error"), ep(None)], 0)]:            # graded once: the judge is up
        Trainer._note_failures(fake, batch)
        assert len(fake._judge_down) == down

    note = Trainer._note_failures      # every update's episodes all fail in the judge
    monkeypatch.setattr(Trainer, "_note_failures", lambda self, t: note(self, [ep("judge_error")]))
    with pytest.raises(JudgeDownError, match=r"failed every episode it was asked to grade in the "
                                             r"last 2 updates \(mostly judge_error; "
                                             r"judge.max_failed_updates=2\); stopped with a checkpoint"):
        _run(tmp_path, max_updates=5, **{"judge.max_failed_updates": 2, "checkpoint.save_every": 10})
    assert check_step(tmp_path / "checkpoints" / "2").valid
    # the stop's checkpoint clears the streak (the judge is fixed, then the run resumed) ...
    assert _final(tmp_path).train_state["failure_streaks"] == {"judge": [], "rollout": []}
    # ... but one saved in the middle of a streak keeps it: a run stopped after 1 failed update
    # of 2 stops at the first failed update after its resume, as a straight run would
    _run(tmp_path / "mid", max_updates=1, **{"judge.max_failed_updates": 2})
    assert _final(tmp_path / "mid").train_state["failure_streaks"]["judge"] == ["judge_error"]
    with pytest.raises(JudgeDownError, match=r"in the last 2 updates"):
        _run(tmp_path / "mid", resume=True, max_updates=5, **{"judge.max_failed_updates": 2})
    assert check_step(tmp_path / "mid" / "checkpoints" / "2").valid
    # a stop signal during the update that reaches the limit: the run stops for the judge
    # there (its stop saved the full streak, and the resume played a third failing update)
    with pytest.raises(JudgeDownError, match=r"in the last 2 updates"):
        _run(tmp_path / "signal", sigterm_after=2, max_updates=5, **{"judge.max_failed_updates": 2})
    assert _final(tmp_path / "signal").train_state["failure_streaks"]["judge"] == []
    # never stopping for it (0), the streak kept is its last entry, not the run's history
    _run(tmp_path / "never", max_updates=3, **{"judge.max_failed_updates": 0})
    assert _final(tmp_path / "never").train_state["failure_streaks"]["judge"] == ["judge_error"]


def test_a_sampler_that_fails_every_episode_stops_the_run_with_a_checkpoint(tmp_path, monkeypatch):
    """A rollout that raises in our own sampler masked every episode ("rollout_error") and the
    run went on to exit 0 with nothing trained (how a multi-host launch once failed)."""
    from types import SimpleNamespace

    from jscenegen.generate.sampler import Sampler
    from jscenegen.grpo.train.trainer import RolloutDownError

    def ep(cause):
        return SimpleNamespace(failure_cause=cause, failure_message="RuntimeError: x")

    fake = SimpleNamespace(_judge_down=[], _rollout_down=[], cfg=_cfg())
    for batch, down in [([ep("rollout_error"), ep("runtime_error")], 1),
                        ([ep("rollout_error"), ep("bad_json")], 0),      # the policy failed one
                        ([ep("rollout_error")], 1), ([ep("rollout_error")], 2),
                        ([ep("rollout_error"), ep(None)], 0),
                        ([ep("rollout_error")], 1),
                        ([ep("prompt_over_cap")] * 2, 0)]:   # a too-long scene: no streak
        Trainer._note_failures(fake, batch)
        assert len(fake._rollout_down) == down

    def broken(self, *args, **kwargs):
        raise RuntimeError("Fetching value for `jax.Array` that spans non-addressable devices")

    monkeypatch.setattr(Sampler, "decode", broken)
    with pytest.raises(RolloutDownError, match=r"every episode of the last 2 updates failed in the "
                                               r"rollout itself, not the policy \(last: rollout_error: "
                                               r"RuntimeError: Fetching value .*rollout.max_failed_"
                                               r"updates=2\); stopped with a checkpoint"):
        _run(tmp_path, max_updates=5, **{"rollout.max_failed_updates": 2, "checkpoint.save_every": 10})
    assert check_step(tmp_path / "checkpoints" / "2").valid


def test_episodes_that_all_fail_at_their_start_stop_the_run_like_any_rollout_failure(tmp_path, monkeypatch):
    """Every episode failing before its first token (a scene runtime that cannot start: an
    invalid scene.metrics.cell_m did it) left a batch of empty rows, and the role mask raised
    IndexError on it; now such updates count as rollout failures like any other."""
    from jscenegen.grpo.train.trainer import RolloutDownError
    from jscenegen.scene.episode import Episode

    def broken(self):
        raise RuntimeError("the scene runtime cannot start")

    chat_model_dir()   # made (once) from scripted episodes, before the runtime breaks
    monkeypatch.setattr(Episode, "first_user_message", broken)
    with pytest.raises(RolloutDownError, match=r"rollout_error: RuntimeError: the scene runtime "
                                               r"cannot start"):
        _run(tmp_path, max_updates=5, **{"rollout.max_failed_updates": 2, "checkpoint.save_every": 10})
    assert check_step(tmp_path / "checkpoints" / "2").valid


def test_swanlab_online_without_a_login_is_one_error_naming_the_setting(tmp_path, monkeypatch):
    """swanlab.init raised RuntimeError ("no TTY is available for interactive login"): a
    36-line traceback and exit 1 (helper-70); and only once the model had loaded: with no API
    key where swanlab's login looks and no terminal to ask on, the setting is refused before
    swanlab starts (`check_swanlab_mode`, which train calls before any model; helper-72)."""
    import io

    import swanlab

    from jscenegen.grpo.train.metrics import LoggingConfig, MetricsLogger, check_swanlab_mode

    started = []

    def no_login(**kwargs):
        started.append(kwargs)
        raise RuntimeError("Failed to initialize SwanLab in online mode: no TTY is available")

    monkeypatch.setattr(swanlab, "init", no_login)
    monkeypatch.delenv("SWANLAB_API_KEY", raising=False)
    monkeypatch.setenv("SWANLAB_ROOT", str(tmp_path / "swanlab-home"))   # no .netrc there
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    online = LoggingConfig(swanlab_mode="online")
    no_key = (r"^logging\.swanlab_mode=online: swanlab has no API key \(log in first with `swanlab "
              r"login`, or set the SWANLAB_API_KEY environment variable\) and no terminal to ask "
              r"for one; or use offline$")
    with pytest.raises(ValueError, match=no_key):
        check_swanlab_mode(online)
    with pytest.raises(ValueError, match=no_key):
        MetricsLogger(tmp_path / "run", online, {})
    assert started == [] and not (tmp_path / "run" / "swanlab").exists()

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdin", Terminal(""))   # swanlab asks on the terminal: its call
    check_swanlab_mode(online)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    monkeypatch.setenv("SWANLAB_API_KEY", " ")   # empty: no key
    with pytest.raises(ValueError, match=no_key):
        check_swanlab_mode(online)
    monkeypatch.setenv("SWANLAB_ROOT", str(tmp_path / "run" / "a-file"))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "a-file").write_text("")
    check_swanlab_mode(online)   # settings swanlab refuses: its start names the setting
    monkeypatch.setenv("SWANLAB_ROOT", str(tmp_path / "swanlab-home"))
    monkeypatch.setenv("SWANLAB_API_KEY", "sk-0123456789")   # a key: the start decides
    check_swanlab_mode(online)
    with pytest.raises(ValueError, match=r"^logging\.swanlab_mode=online: swanlab could not start "
                       r"\(RuntimeError: Failed to initialize SwanLab .*\); log in first \(`swanlab login`, or "
                       r"the SWANLAB_API_KEY environment variable\) with the SwanLab cloud "
                       r"reachable, or use offline$"):
        MetricsLogger(tmp_path, online, {})
    assert len(started) == 1


def test_swanlab_refusing_the_login_is_one_error_and_leaves_no_swanlab_directory(tmp_path,
                                                                                  monkeypatch):
    """A key but no reachable cloud: swanlab raised its AuthenticationError (no RuntimeError),
    a traceback, and the swanlab/ it had made blocked a new start in that --run-dir
    (helper-72)."""
    import swanlab

    from jscenegen.grpo.train.metrics import LoggingConfig, MetricsLogger

    class AuthenticationError(Exception):
        pass

    def refused(**kwargs):
        Path(kwargs["log_dir"]).mkdir(parents=True, exist_ok=True)
        raise AuthenticationError("Failed to initialize the SwanLab client: sk-SWANKEY-0123456789")

    monkeypatch.setenv("SWANLAB_API_KEY", "sk-SWANKEY-0123456789")
    monkeypatch.setattr(swanlab, "init", refused)
    with pytest.raises(ValueError) as info:
        MetricsLogger(tmp_path, LoggingConfig(swanlab_mode="online"), {})
    assert str(info.value).startswith("logging.swanlab_mode=online: swanlab could not start "
                                      "(AuthenticationError: Failed to initialize the SwanLab "
                                      "client: <redacted>); log in first")
    assert sorted(tmp_path.iterdir()) == []
    (tmp_path / "swanlab").mkdir()          # one that was there before is not swanlab's to remove
    with pytest.raises(ValueError) as info:  # offline: no login to advise (a full disk, a bug)
        MetricsLogger(tmp_path, LoggingConfig(swanlab_mode="offline"), {})
    assert (tmp_path / "swanlab").is_dir()
    assert str(info.value).endswith("<redacted>); JSCENEGEN_DEBUG=1 shows where")


def test_swanlabs_banner_reaches_a_log_file_one_line_per_message(tmp_path, capsys):
    """swanlab prints its banner through a rich Console, which broke every line at the console
    width (80 columns when no terminal is open, as in a log file) in the middle of the run's
    path: a fresh user's log held `Run data saved at` and the path on the next lines, cut. Each
    message is now one line, on stderr (stdout is the run's JSON line only). The path is longer
    than any terminal is wide (rich takes an open terminal's width)."""
    run_dir = tmp_path / ("d" * 200) / ("e" * 200) / "run"
    from jscenegen.grpo.train.metrics import LoggingConfig, MetricsLogger

    logger = MetricsLogger(run_dir, LoggingConfig(swanlab_mode="offline"), {})
    logger.log({"reward": 0.5}, step=0)
    logger.close()
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines and all(line.startswith("swanlab: ") for line in lines), lines
    saved = [m for line in lines if (m := re.fullmatch(r"swanlab: \S* ?Run data saved at (\S+)", line))]
    synced = [m for line in lines if (m := re.fullmatch(r"swanlab: \S* ?Run `swanlab sync (\S+)` to "
                                                        r"sync this run", line))]
    assert len(saved) == len(synced) == 1, lines
    where = Path(saved[0][1])
    assert where.parent == run_dir / "swanlab" and where.name.startswith("run-") and where.is_dir()
    assert synced[0][1] == str(where)


def test_a_credential_from_the_environment_is_masked_in_what_swanlab_recorded(tmp_path,
                                                                               monkeypatch, capsys):
    """swanlab records the run's stderr and warnings in RUN_DIR/swanlab; only the command
    line's credentials were masked there, so a judge key a server echoed into a warning stayed
    (helper-72)."""
    import logging

    from jscenegen.grpo.train.metrics import LoggingConfig, MetricsLogger

    secret = "sk-ENVSECRET-4f9a1c"
    monkeypatch.setenv("JSCENEGEN_JUDGE_API_KEY", secret)
    logger = MetricsLogger(tmp_path, LoggingConfig(swanlab_mode="offline"), {})
    logging.getLogger("jscenegen.test").warning("judge said: invalid key Bearer %s", secret)
    print(f"stderr line with {secret}", file=sys.stderr, flush=True)
    logger.log({"reward": 0.5}, step=0)
    logger.close()
    files = [p for p in (tmp_path / "swanlab").rglob("*") if p.is_file()]
    assert files and not [p for p in files if secret.encode() in p.read_bytes()]
    masked = b"*" * len(secret)
    assert any(masked in p.read_bytes() for p in files)   # it was recorded, masked


def test_a_dev_plot_that_cannot_be_drawn_costs_a_warning_not_the_run(tmp_path, monkeypatch, caplog):
    """A plot error at eval_before ended the run before GRPO (helper-171); the report is
    written, an earlier plot of that name removed, and the evaluation returned."""
    import types

    import jscenegen.eval.evaluate
    import jscenegen.eval.plots
    from jscenegen.grpo.train.schedule import SchedulePosition

    def broken(report, out, **kw):
        raise ValueError("Unknown symbol: \\bad")

    monkeypatch.setattr(jscenegen.eval.evaluate, "evaluate", lambda engine, records, **kw: {
        "overall": {"model": {"reward": 0.25}}})
    monkeypatch.setattr(jscenegen.eval.plots, "plot_report", broken)
    (tmp_path / "eval_before.png").write_bytes(b"an earlier run's plot")
    trainer = types.SimpleNamespace(cfg=_cfg(), engine=None, judge=None, run_dir=tmp_path,
                                    pos=SchedulePosition(attempts=0, effective_updates=0),
                                    _last_eval=None)
    with caplog.at_level(logging.WARNING):
        report = Trainer.evaluate_dev(trainer, "eval_before")
    assert report["overall"]["model"]["reward"] == 0.25
    assert json.loads((tmp_path / "eval_before.json").read_text()) == report
    assert not (tmp_path / "eval_before.png").exists()
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"plot {tmp_path / 'eval_before.png'} not drawn (ValueError: Unknown symbol: \\bad)"]


def test_weights_already_evaluated_are_not_played_again(tmp_path, monkeypatch, capsys):
    """With `trainer.eval_every` dividing the run's updates and `eval_before_after`, the last
    update's weights were played twice (eval_update_U, then eval_after): the same fixed-seed
    episodes, twice the judge calls. The reports say `attempts` (a count, as checkpoints/N)."""
    import types

    import jscenegen.eval.evaluate
    import jscenegen.eval.plots
    from jscenegen.grpo.train.schedule import SchedulePosition

    played = []

    def evaluate(engine, records, **kw):
        played.append(len(records))
        return {"overall": {"model": {"reward": 0.25 * len(played)}}}

    monkeypatch.setattr(jscenegen.eval.evaluate, "evaluate", evaluate)
    monkeypatch.setattr(jscenegen.eval.plots, "plot_report",
                        lambda report, out, before=None: out.write_bytes(b"png"))
    trainer = types.SimpleNamespace(cfg=_cfg(), engine=None, judge=None, run_dir=tmp_path,
                                    pos=SchedulePosition(attempts=3, effective_updates=2),
                                    _last_eval=None)
    first = Trainer.evaluate_dev(trainer, "eval_update_2")
    again = Trainer.evaluate_dev(trainer, "eval_after")
    assert len(played) == 1 and again == first
    assert (first["attempts"], first["effective_updates"]) == (3, 2)
    assert (json.loads((tmp_path / "eval_after.json").read_text())
            == json.loads((tmp_path / "eval_update_2.json").read_text()) == first)
    trainer.pos = SchedulePosition(attempts=4, effective_updates=2)   # an attempt without a step
    assert Trainer.evaluate_dev(trainer, "eval_after")["overall"]["model"]["reward"] == 0.5
    assert len(played) == 2
    assert capsys.readouterr().err == ""      # trainer.progress=false
    trainer.cfg = _cfg(**{"trainer.progress": "true"})
    trainer.pos = SchedulePosition(attempts=5, effective_updates=3)
    Trainer.evaluate_dev(trainer, "eval_update_3")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "eval_update_3: playing 9 dev scenes x 16 episodes"   # cpu-default.yaml
    assert re.fullmatch(r"eval_update_3: reward \+0\.750 \(\d+ s\)", lines[1]) and len(lines) == 2


def test_an_evaluation_interval_beyond_the_schedule_is_warned_about(caplog):
    from jscenegen.pipeline import check_run_inputs

    with caplog.at_level("WARNING"):
        check_run_inputs(_cfg(**{"trainer.eval_every": 4}))     # 3 updates
    assert "trainer.eval_every=4 is more than schedule.total_updates=3" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        check_run_inputs(_cfg(**{"trainer.eval_every": 3}))
    assert "eval_every" not in caplog.text
    with caplog.at_level("WARNING"):
        check_run_inputs(_cfg(**{"judge.model": "judge-27b"}))
    assert "judge.model has no effect without judge.backend: http" in caplog.text


def test_swanlab_local_mode_without_its_dashboard_is_refused_before_the_model(tmp_path, monkeypatch):
    """swanlab's `local` mode without swanboard logged an ERROR and went on: exit 0, no dashboard
    (helper-82)."""
    import importlib.util

    from jscenegen.grpo.train.metrics import LoggingConfig, MetricsLogger
    from jscenegen.pipeline import check_run_inputs

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, package=None: None if name == "swanboard" else real(name, package))
    expected = r"^logging\.swanlab_mode=local needs swanlab's dashboard \(pip install 'swanlab\[dashboard\]'\)"
    with pytest.raises(ValueError, match=expected):
        check_run_inputs(_cfg(**{"logging.swanlab_mode": "local"}))
    with pytest.raises(ValueError, match=expected):
        MetricsLogger(tmp_path, LoggingConfig(swanlab_mode="local"), {})
    assert list(tmp_path.iterdir()) == []
    check_run_inputs(_cfg(**{"logging.swanlab_mode": "offline"}))


def test_swanlab_leaves_the_programs_sigint_handler_and_a_stopped_start_leaves_no_swanlab_files(
        tmp_path, monkeypatch):
    """swanlab.init installed its own SIGINT handler: a Ctrl-C in the first dev evaluation
    printed swanlab's lines to stdout and recorded the run as aborted; and a stop during its
    start (or before the run's files were written) left a run directory holding only a
    half-written swanlab/ (helper-87)."""
    import signal

    import swanlab

    from jscenegen.grpo.train.metrics import LoggingConfig, MetricsLogger
    from jscenegen.signals import Terminated

    def ours(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, ours)
    try:
        logger = MetricsLogger(tmp_path / "a", LoggingConfig(swanlab_mode="offline"), {})
        assert signal.getsignal(signal.SIGINT) is ours
        assert (tmp_path / "a" / "swanlab").is_dir()
        logger.close(discard=True)      # a start that wrote nothing: its swanlab/ goes
        assert not (tmp_path / "a" / "swanlab").exists()
        (tmp_path / "b" / "swanlab").mkdir(parents=True)    # a resumed run's own
        logger = MetricsLogger(tmp_path / "b", LoggingConfig(swanlab_mode="offline"), {})
        logger.close(discard=True)
        assert (tmp_path / "b" / "swanlab").is_dir()
    finally:
        signal.signal(signal.SIGINT, previous)

    def stopped(**kwargs):
        (tmp_path / "c" / "swanlab" / "run-x").mkdir(parents=True)
        (tmp_path / "c" / "swanlab" / "run-x" / "run-x.swanlab").write_bytes(b"")
        raise Terminated

    monkeypatch.setattr(swanlab, "init", stopped)
    with pytest.raises(Terminated):
        MetricsLogger(tmp_path / "c", LoggingConfig(swanlab_mode="offline"), {})
    assert list((tmp_path / "c").iterdir()) == []


def test_a_dev_set_no_report_can_hold_is_refused_before_the_warm_start(tmp_path):
    """`evaluate` refuses a scene without scene_id whose report name `scene-<i>` is another
    scene's id, and `eval --compare` (a resume's comparison) a report of more than
    MAX_REPORT_EPISODES episodes: `train` met the first at its first dev evaluation, after the
    SFT warm start, and wrote the second. Both are refused by `check_run_inputs`, only when the
    dev set is evaluated, with the episodes per scene of `evaluation_samples` (1 under greedy)."""
    from jscenegen.pipeline import check_run_inputs

    dev = [json.loads(line) for line in open(resolve_data_path("data/scenes/dev.jsonl"))]
    dev[0]["scene"].pop("scene_id")
    dev[1]["scene"]["scene_id"] = "scene-0"
    clash = tmp_path / "clash.jsonl"
    clash.write_text("".join(json.dumps(r) + "\n" for r in dev))
    with pytest.raises(ValueError, match=r"clash\.jsonl: scene 0 \(line 1\) has no scene_id, and "
                                         r"the name a report gives it, 'scene-0', is the scene_id "
                                         r"of scene 1 \(line 2\)"):
        check_run_inputs(_cfg(**{"schedule.dev_set": str(clash)}))
    check_run_inputs(_cfg(**{"schedule.dev_set": str(clash), "trainer.eval_before_after": "false"}))
    big = tmp_path / "big.jsonl"   # 109 scenes x 4,096 samples: more than a report holds
    big.write_text(open(resolve_data_path("data/scenes/train.jsonl")).read()
                   + open(resolve_data_path("data/scenes/dev.jsonl")).read())
    with pytest.raises(ValueError, match=r"big\.jsonl: 109 scenes x 4096 samples = 446,464 episodes"):
        check_run_inputs(_cfg(**{"schedule.dev_set": str(big), "trainer.eval_samples": 4096}))
    check_run_inputs(_cfg(**{"schedule.dev_set": str(big), "trainer.eval_samples": 4096,
                             "sampling.greedy": "true", "sampling.top_p": 1.0}))  # 1 each


def test_greedy_dev_evaluations_play_one_episode_per_scene(tmp_path, monkeypatch):
    """Argmax decoding ignores the sampling seed: a run's dev evaluations under
    sampling.greedy played trainer.eval_samples identical episodes of each scene (and `eval
    --compare` of such a report against a greedy `jscenegen eval` report was refused for
    different seeds). They play 1, as `jscenegen eval --greedy` (`evaluation_samples`)."""
    import types

    import jscenegen.eval.evaluate
    import jscenegen.eval.plots
    from jscenegen.grpo.train.schedule import SchedulePosition

    samples = []
    monkeypatch.setattr(jscenegen.eval.evaluate, "evaluate", lambda engine, records, **kw: (
        samples.append(kw["samples"]) or {"overall": {"model": {"reward": 0.0}}}))
    monkeypatch.setattr(jscenegen.eval.plots, "plot_report", lambda report, out, before=None: None)
    for greedy, expected in (("false", 16), ("true", 1)):   # cpu-default.yaml: eval_samples 16
        cfg = _cfg(**{"sampling.greedy": greedy, "sampling.top_p": 1.0})
        trainer = types.SimpleNamespace(cfg=cfg, engine=None, judge=None, run_dir=tmp_path,
                                        pos=SchedulePosition(attempts=0, effective_updates=0),
                                        _last_eval=None)
        Trainer.evaluate_dev(trainer, "eval_before")
        assert samples[-1] == expected
    assert jscenegen.eval.evaluate.evaluation_samples(cfg) == 1   # the rule `eval` applies
    assert jscenegen.eval.evaluate.evaluation_samples(cfg, 3) == 3   # eval's --samples, as given


def test_an_extended_resume_plays_the_appended_scene_and_an_edited_scene_is_refused(straight,
                                                                                   tmp_path):
    """The straight run finished its pass over 3 scenes (saved at scene 0 of epoch 1): extended
    to 4 it replayed scene 0 (helper-134 #1); it plays scene 3 of epoch 0, as a 4-scene run.
    A scene edited in place (same place and seed) is refused by the saved scenes_hash."""
    import dataclasses
    import shutil

    from jscenegen.scene.sceneset import read_scene_set, write_scene_set
    from jscenegen.scene.schema import scene_from_json

    run_dir = shutil.copytree(straight[0], tmp_path / "run")
    assert _final(run_dir).train_state["schedule"]["epoch"] == 1
    _, summary = _run(run_dir, resume=True, **{"schedule.num_scenes": 4,
                                               "schedule.total_updates": 4})
    assert summary.attempts == 4
    assert [(r["scene_index"], r["epoch"]) for r in _metrics(run_dir)][3] == (3, 0)
    records = read_scene_set(resolve_data_path("data/scenes/train.jsonl"))[:4]
    scene = records[1].scene.to_json()
    edited = list(records)
    edited[1] = dataclasses.replace(records[1], scene=scene_from_json(
        {**scene, "prompt": scene["prompt"] + " with a plant"}))
    write_scene_set(tmp_path / "edited.jsonl", edited)
    with pytest.raises(ResumeError, match="the content of the first 4 scenes of .*edited.jsonl "
                                          "changed"):
        Trainer(_cfg(**{"schedule.train_set": tmp_path / "edited.jsonl",
                        "schedule.num_scenes": 4, "schedule.total_updates": 5}),
                run_dir, chat_model_dir(), resume=True)


def test_an_evaluation_cut_off_by_a_stop_or_a_kill_is_played_on_resume(tmp_path, monkeypatch):
    """A SIGTERM during the update that reached a multiple of trainer.eval_every stopped before
    its evaluation, and a kill during the evaluation came after the checkpoint: either way the
    resumed run never played it (helper-153). Now the metrics rows and reports equal a
    straight run's."""
    import jscenegen.eval.evaluate
    import jscenegen.eval.plots

    calls = []

    def evaluate(engine, records, **kw):
        calls.append(1)
        if crash_at and len(calls) == crash_at:
            raise RuntimeError("killed during the evaluation")
        return {"overall": {"model": {"reward": 0.5}}}

    monkeypatch.setattr(jscenegen.eval.evaluate, "evaluate", evaluate)
    monkeypatch.setattr(jscenegen.eval.plots, "plot_report",
                        lambda report, out, before=None: out.write_bytes(b"png"))
    every = {"trainer.eval_every": 1, "schedule.total_updates": 2}

    def shape(run_dir):
        rows = [(r["attempt"], "eval/reward" in r) for r in _metrics(run_dir)]
        return rows, sorted(p.name for p in run_dir.glob("eval_update_*.json"))

    crash_at = None
    _run(tmp_path / "straight", **every)
    expected = shape(tmp_path / "straight")
    assert expected == ([(0, False), (0, True), (1, False), (1, True)],
                        ["eval_update_1.json", "eval_update_2.json"])
    _, first = _run(tmp_path / "stopped", sigterm_after=1, **every)
    assert first.stopped_by_signal and shape(tmp_path / "stopped")[1] == []
    _run(tmp_path / "stopped", resume=True, **every)
    assert shape(tmp_path / "stopped") == expected
    crash_at = len(calls) + 2          # the second evaluation of the next run
    with pytest.raises(RuntimeError, match="killed during the evaluation"):
        _run(tmp_path / "killed", **every)
    assert shape(tmp_path / "killed")[1] == ["eval_update_1.json"]
    crash_at = None
    _run(tmp_path / "killed", resume=True, **every)
    assert shape(tmp_path / "killed") == expected


def test_only_the_runs_own_checkpoint_owes_an_evaluation(tmp_path):
    """A first start from a converted VERL/HF checkpoint at a multiple of eval_every has no
    report of that update in its new run directory: it owes none (it played the whole dev
    set before its first update)."""
    import types

    from jscenegen.grpo.train.schedule import SchedulePosition

    trainer = types.SimpleNamespace(cfg=_cfg(**{"trainer.eval_every": 5}), run_dir=tmp_path,
                                    pos=SchedulePosition(attempts=12, effective_updates=10),
                                    _own_checkpoint=False)
    assert Trainer._owed_evaluation(trainer) is None
    trainer._own_checkpoint = True
    assert Trainer._owed_evaluation(trainer) == 10
    (tmp_path / "eval_update_10.json").write_text("{}")
    assert Trainer._owed_evaluation(trainer) is None
    trainer.pos = SchedulePosition(attempts=12, effective_updates=11)
    assert Trainer._owed_evaluation(trainer) is None
