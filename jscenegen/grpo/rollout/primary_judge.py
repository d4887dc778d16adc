"""One judge call per batch in a multi-process run.

Every process plays the same episodes (same seeds, same weights, tokens read back whole with
`sharding.mesh.host_array`), so every process would grade them too: N times the judge's cost,
and with a sampling judge (or a retry that succeeds on one host only) N different rewards,
advantages and batches for what must be one global batch. `PrimaryJudge` lets process 0 grade
and hands its results to the others. The model judge is the exception: its decode runs on the
mesh of every process, so every process grades (greedy, or with a key per prompt: the same
answers everywhere). `judge_on_primary` is how rollouts and evaluations grade
their finished episodes.
"""
from __future__ import annotations

import json
import logging
from typing import Sequence

import jax

from jscenegen.scene.episode import Episode, judge_episodes
from jscenegen.scene.judge import Judge, JudgeIdentity, JudgeRequest, JudgeResult
from jscenegen.sharding.mesh import bytes_from_primary, fails_the_joined_run, is_primary

log = logging.getLogger(__name__)


class PrimaryJudge:
    """A `scene.judge.Judge` whose `grade` runs on process 0 only; every process returns
    process 0's results (JSON over `sharding.mesh.bytes_from_primary`, a collective: every
    process calls `grade` at the same point with the same number of requests). `identity` and
    `check_reachable` are the wrapped judge's."""

    def __init__(self, judge: Judge):
        self.judge = judge
        # the collective's own failure (a peer gone): the caller's per-episode masking
        # (`scene.episode.judge_episodes`) would catch it, so the engine re-raises it from here
        self.run_broken: BaseException | None = None

    def identity(self) -> JudgeIdentity:
        return self.judge.identity()

    def check_reachable(self) -> None:
        self.judge.check_reachable()

    def grade(self, requests: Sequence[JudgeRequest]) -> list[JudgeResult]:
        """Process 0's `judge.grade(requests)` on every process. Raises RuntimeError on every
        process when it raised there (naming its type), or returned another count."""
        payload = None
        if is_primary():
            try:
                rows = [[r.grades, r.failure, r.info] for r in self.judge.grade(requests)]
            except Exception as err:  # the others wait for this broadcast: send the failure
                rows = {"error": type(err).__name__}
            payload = json.dumps(rows, default=str).encode()
        try:
            shared = bytes_from_primary(payload)
        except Exception as err:
            if fails_the_joined_run(err):
                self.run_broken = err
            raise
        rows = json.loads(shared)
        if isinstance(rows, dict):
            raise RuntimeError(f"the judge raised {rows['error']} on process 0")
        if len(rows) != len(requests):
            raise RuntimeError(f"process 0 graded {len(rows)} episodes, this process "
                               f"{jax.process_index()} asked for {len(requests)}")
        return [JudgeResult(grades, failure, info) for grades, failure, info in rows]


def for_processes(judge: Judge) -> Judge:
    """`judge` itself in one process or when every process must grade
    (`grades_on_every_process`: the model judge, whose decode is a collective over the mesh
    and answers alike everywhere), else a PrimaryJudge around it."""
    if jax.process_count() == 1 or getattr(judge, "grades_on_every_process", False):
        return judge
    return PrimaryJudge(judge)


def judge_on_primary(episodes: Sequence[Episode], judge: Judge) -> None:
    """Grade the finished `episodes` in one `judge` call, made by process 0 alone in a
    multi-process run (`for_processes`; every process calls this at the same point with the
    same episodes), and set each episode's judgement. A judge exception masks the episodes it
    left ungraded ("judge_error"); a failure of the run itself (a peer gone:
    `sharding.mesh.fails_the_joined_run`) is raised."""
    graded = for_processes(judge)
    try:
        judge_episodes(episodes, graded)
    except Exception as err:  # judge_episodes masks judge exceptions itself; this is a backstop
        if fails_the_joined_run(err):
            raise
        log.exception("judging failed")
        for ep in episodes:
            if ep.judge_request() is not None:
                ep.set_judgement(JudgeResult(None, "judge_error", {"detail": type(err).__name__}))
    # a judge that met a failure of the joined run (PrimaryJudge's collective, the model
    # judge's decode) keeps it in `run_broken`: masked per episode above, it ends the run here
    if getattr(graded, "run_broken", None) is not None:
        raise graded.run_broken
