"""The one way a command or the trainer gets its judge: `build_judge(cfg, mesh=...)`.

The scene runtime builds the rule and HTTP judges (`scene.judge.make_judge`) but knows no JAX
model, so the model judge (`judge.backend: model`, `grpo.rollout.model_judge.ModelJudge`) is
built here, where both are visible. Importing this module imports no JAX: the model judge's
module is imported only for that backend.
"""
from __future__ import annotations

from jscenegen.scene import judge as scene_judge
from jscenegen.scene.judge import Judge


def build_judge(cfg, *, mesh=None, load: bool = False) -> Judge:
    """The judge of the run config `cfg` (`run_config.RunConfig`: its `judge` and `scene`
    sections; for the model judge also `model` (compute dtype, attention), `rollout` (dtype,
    memory_fraction) and `sampling.buckets`): `ModelJudge` for `judge.backend: model` on
    `mesh` (None: one device), its weights loaded now with `load` (else by `load_judge` or
    its first grading); `scene.judge.make_judge` for the others."""
    if cfg.judge.backend != "model":
        return scene_judge.make_judge(cfg.judge, cfg.scene)   # looked up now (tests replace it)
    from jscenegen.grpo.rollout.model_judge import ModelJudge
    from jscenegen.model.options import attention_for_backend
    from jscenegen.scene.prompts import load_templates

    compute = cfg.model.compute_dtype
    weights = cfg.rollout.dtype or compute   # the rollout dtype: loaded in it, never cast again
    judge = ModelJudge(cfg.judge, load_templates(cfg.scene.prompts_dir), cfg.scene.metrics,
                       mesh=mesh, buckets=cfg.sampling.buckets,
                       memory_fraction=cfg.rollout.memory_fraction, weight_dtype=weights,
                       model_options=dict(param_dtype=weights, compute_dtype=compute,
                                          attn_impl=attention_for_backend(cfg.model.attention, compute)))
    if load:
        judge.load()
    return judge


def load_judge(judge: Judge) -> None:
    """Load a model judge's weights now (`ModelJudge.load`: once per process), so that a
    judge that cannot load fails the command before its first grading; nothing for the
    others."""
    load = getattr(judge, "load", None)
    if callable(load):
        load()
