"""The episode state machine: one conversation, three roles, caps, finish and judging.

Both drivers use this one class: the scripted runner (expert.py) and the model-driven rollout.
A driver shows `system_prompt()` and `first_user_message()`, then loops: generate the answer of
`next_role`, pass the assistant text to `step`, append the returned environment message (role
`user` in the chat template) until `done`. Token caps and truncation are the driver's to detect;
it reports them with `fail(cause)`. Finished episodes are judged in batches by `judge_episodes`
(one judge call for the G episodes of a group), after which `outcome` holds the reward.

Protocol (scene-protocol.md section 2): the planner acts first and after every designer or critic
turn; `design` hands over to the designer, `critique` to the critic (at most max_critique_rounds;
a further request is refused with a message, not failed), `revert` restores the scene the critic
last saw (units are not refunded), `finish` ends the episode. The planner's max_planner_turns-th
turn must be `finish`, else the episode fails with planner_turn_cap.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Sequence

from .actions import parse_action
from .catalogue import Catalogue, catalogue_text, load_catalogue
from .config import JudgeConfig, SceneRuntimeConfig, grade_template
from .judge import Judge, JudgeRequest, JudgeResult, judge_error_detail
from .metrics import measure, metrics_text
from .ops import SceneEditor, op_costs_text, op_table
from .prompts import PromptTemplates, load_templates
from .reward import MASKED_FAILURES, POLICY_FAILURES, Outcome, failed_outcome, judged_outcome
from .sceneset import SceneRecord
from .schema import Budget, Scene, canonical_text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    """What the driver appends next: `env_message` (None when done), `done`, and a failure cause."""

    env_message: str | None
    done: bool
    failure_cause: str | None = None


class Episode:
    """One episode on `record`; see the module docstring for the driver loop."""

    def __init__(
        self,
        record: SceneRecord,
        cfg: SceneRuntimeConfig | None = None,
        judge_cfg: JudgeConfig | None = None,
        templates: PromptTemplates | None = None,
        catalogue: Catalogue | None = None,
    ):
        self.cfg = cfg or SceneRuntimeConfig()
        self.judge_cfg = judge_cfg or JudgeConfig()
        self.templates = templates or load_templates(self.cfg.prompts_dir)
        self.catalogue = catalogue or load_catalogue(self.cfg.catalogue_path)
        self.record = record
        scene = record.scene.model_copy(update={"budget": Budget(total_units=self.cfg.budget_units, used_units=0)})
        self.editor = SceneEditor(scene, self.cfg, self.catalogue)
        self.next_role: str | None = "planner"
        self.planner_turns = 0
        self.critique_rounds = 0
        self.critic_scene: Scene | None = None
        self.failure_cause: str | None = None
        self.failure_message = ""
        self.finished = False
        self.terminal_metrics: dict | None = None
        self.outcome: Outcome | None = None
        self.events: list[dict] = []

    # ---- state -----------------------------------------------------------------------------
    @property
    def scene(self) -> Scene:
        return self.editor.scene

    @property
    def units(self) -> int:
        return self.scene.budget.used_units

    @property
    def done(self) -> bool:
        return self.next_role is None

    def _metrics(self, blockers: bool = False) -> dict:
        return measure(self.scene, self.cfg, self.catalogue, blockers=blockers)

    # ---- prompts ---------------------------------------------------------------------------
    def system_prompt(self) -> str:
        """The system message: protocol, roles, operations with costs, reward, categories."""
        r = self.cfg.reward
        return self.templates.render(
            "system",
            max_critique_rounds=self.cfg.max_critique_rounds,
            max_planner_turns=self.cfg.max_planner_turns,
            budget=self.cfg.budget_units,
            op_table=op_table(self.cfg),
            op_costs=op_costs_text(self.cfg),
            grade_template=grade_template(self.judge_cfg.grade_keys),
            unit_penalty=r.unit_penalty,
            unit_norm=r.unit_norm,
            failure_reward=r.failure_reward,
            catalogue=catalogue_text(self.catalogue),
        )

    def first_user_message(self) -> str:
        """The user message: the request, the empty room and its metrics; the planner acts next."""
        return self.templates.render(
            "first_user",
            prompt=self.scene.prompt,
            scene=canonical_text(self.scene),
            metrics=metrics_text(self._metrics()),
            turn=1,
            max_planner_turns=self.cfg.max_planner_turns,
        )

    def _to_planner(self, result: str) -> StepResult:
        self.next_role = "planner"
        msg = self.templates.render(
            "planner",
            result=result,
            turn=self.planner_turns + 1,
            max_planner_turns=self.cfg.max_planner_turns,
            critiques_left=self.cfg.max_critique_rounds - self.critique_rounds,
            used_units=self.units,
            budget=self.cfg.budget_units,
        )
        return StepResult(msg, False)

    # ---- transitions -----------------------------------------------------------------------
    def step(self, assistant_text: str) -> StepResult:
        """Consume the answer of `next_role`; return the next environment message or the end.

        Policy failures (malformed action, role violation, cap) end the episode with their cause;
        an exception inside the runtime ends it with the masked cause "runtime_error".
        Raises RuntimeError when the episode is already done (a driver bug).
        """
        if self.done:
            raise RuntimeError("step() on a finished episode")
        role = self.next_role
        parsed = parse_action(assistant_text, role, self.judge_cfg.grade_keys)
        self.events.append({"role": role, "failure": parsed.failure_cause, "units": self.units})
        if not parsed.ok:
            return self.fail(parsed.failure_cause, parsed.message)
        try:
            return getattr(self, f"_{role}")(parsed.payload)
        except Exception as err:  # our own bug: not the policy's fault
            log.exception("runtime error in %s step", role)
            return self.fail("runtime_error", f"{type(err).__name__}: {err}")

    def fail(self, cause: str, message: str = "") -> StepResult:
        """End the episode with failure `cause` (policy or masked; see reward.py). Returns the final StepResult."""
        if cause not in POLICY_FAILURES + MASKED_FAILURES:
            raise ValueError(f"unknown failure cause {cause!r}")
        if self.outcome is not None:
            raise RuntimeError("the episode already has an outcome")
        self.next_role = None
        self.failure_cause, self.failure_message = cause, message
        self.outcome = failed_outcome(cause, self.units, self.cfg.reward)
        return StepResult(None, True, cause)

    def _planner(self, act: dict) -> StepResult:
        self.planner_turns += 1
        kind = act["action"]
        if kind == "finish":
            return self._finish()
        if self.planner_turns >= self.cfg.max_planner_turns:
            return self.fail("planner_turn_cap", f"turn {self.planner_turns} was {kind!r}, not finish")
        if kind == "design":
            self.next_role = "designer"
            msg = self.templates.render(
                "designer", instruction=act["instruction"], scene=canonical_text(self.scene),
                metrics=metrics_text(self._metrics()),
            )
            return StepResult(msg, False)
        if kind == "critique":
            if self.critique_rounds >= self.cfg.max_critique_rounds:
                return self._to_planner(
                    f"Critique refused: all {self.cfg.max_critique_rounds} critique rounds are used."
                )
            self.critique_rounds += 1
            self.critic_scene = self.scene
            self.next_role = "critic"
            msg = self.templates.render(
                "critic", prompt=self.scene.prompt, scene=canonical_text(self.scene),
                metrics=metrics_text(self._metrics(blockers=True)),
                grade_keys=", ".join(self.judge_cfg.grade_keys),
            )
            return StepResult(msg, False)
        # revert
        if self.critic_scene is None:
            return self._to_planner("Revert refused: the critic has not seen a scene yet.")
        self.editor.scene = self.critic_scene.model_copy(update={"budget": self.scene.budget})
        return self._to_planner(
            f"Reverted to the scene the critic last saw ({len(self.scene.objects)} objects); units are not refunded."
        )

    def _designer(self, ops) -> StepResult:
        lines, refused = self.editor.apply_batch(ops)
        result = self.templates.render(
            "designer_result", op_results="\n".join(lines) or "(no operations)",
            scene=canonical_text(self.scene), metrics=metrics_text(self._metrics()),
        )
        return self._to_planner(result)

    def _critic(self, crit: dict) -> StepResult:
        grades = json.dumps(crit["grades"], separators=(", ", ": "))
        return self._to_planner(f"Critic: {crit['critique']}\nCritic grades: {grades}")

    def _finish(self) -> StepResult:
        self.next_role = None
        if why := terminal_scene_failure(self.scene):
            return self.fail("invalid_terminal_scene", why)
        self.finished = True
        self.terminal_metrics = self._metrics(blockers=True)
        return StepResult(None, True, None)

    # ---- judging ---------------------------------------------------------------------------
    def judge_request(self) -> JudgeRequest | None:
        """The request for the judge, or None when the episode failed (or is not finished)."""
        if not self.finished or self.outcome is not None:
            return None
        return JudgeRequest(self.scene, self.record.requested, self.terminal_metrics)

    def set_judgement(self, result: JudgeResult, judge_identity: dict | None = None) -> Outcome:
        """Turn the judge's result into the outcome (masked on judge failure)."""
        if self.judge_request() is None:
            raise RuntimeError("set_judgement() needs a finished, not failed, not yet judged episode")
        info = {**result.info, **({"judge": judge_identity} if judge_identity else {})}
        if result.failure is not None:
            self.failure_cause = result.failure
            self.outcome = failed_outcome(result.failure, self.units, self.cfg.reward, self.terminal_metrics, info)
        else:
            self.outcome = judged_outcome(result.grades, self.units, self.cfg.reward, self.terminal_metrics, info)
        return self.outcome


def terminal_scene_failure(scene: Scene) -> str | None:
    """Why `scene` cannot end an episode (spec: an empty final scene is the policy failure
    `invalid_terminal_scene`, reward -1, never judged), or None when it can."""
    return None if scene.objects else "the final scene is empty"


def judge_episodes(episodes: Sequence[Episode], judge: Judge) -> list[Outcome]:
    """Judge every finished episode in one batched call; return all outcomes in order.

    An exception from the judge itself, or a judge that answers another number of results
    than it was asked for, masks the affected episodes ("judge_error"; for an exception its
    type and text, `judge_error_detail`, are the result's
    info["detail"] and the warning's). Raises ValueError
    when an episode is still running.
    """
    running = [i for i, ep in enumerate(episodes) if not ep.done]
    if running:
        raise ValueError(f"episodes {running} are not done")
    todo = [ep for ep in episodes if ep.judge_request() is not None]
    if todo:
        try:
            results = list(judge.grade([ep.judge_request() for ep in todo]))
        except Exception as err:
            detail = judge_error_detail(err)
            log.warning("judge raised %s; masking %d episodes", detail, len(todo))
            results = [JudgeResult(None, "judge_error", {"detail": detail})] * len(todo)
        if len(results) != len(todo):
            log.warning("the judge answered %d results for %d episodes; masking them",
                        len(results), len(todo))
            results = [JudgeResult(None, "judge_error", {"detail": "result count"})] * len(todo)
        ident = judge.identity()
        for ep, res in zip(todo, results):
            ep.set_judgement(res, ident)
    return [ep.outcome for ep in episodes]
