"""`jscenegen design`: furnish one room from a prompt with a trained model playing the three roles."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from jscenegen.commands import seed_arg
from jscenegen.paths import data_path_arg

DEFAULT_ROOM_SEED = 7  # the generated bedroom used when no --room is given (no dev/train seed)


def register(sub) -> None:
    p = sub.add_parser("design", help="furnish one room from a prompt with a model (planner, designer, critic)")
    p.add_argument("--model", required=True, metavar="HF_DIR_OR_CHECKPOINT",
                   help="HF model directory or checkpoint step directory (RUN/checkpoints/N)")
    p.add_argument("--prompt", required=True, help="what the room should be, in words")
    p.add_argument("--room", default=None, help="room JSON (a scene file, its objects are kept; a "
                   "scene-set record; or a bare room object); default: a generated bedroom")
    p.add_argument("-o", "--out", required=True, help="terminal scene JSON to write")
    p.add_argument("--render", default=None, help="also draw the terminal scene to this PNG")
    p.add_argument("--seed", type=seed_arg, default=0, help="episode seed (sampling keys)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (sampling.greedy=true)")
    p.add_argument("--config", default=None, type=data_path_arg, help="run config YAML (default: configs/cpu-default.yaml)")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    p.set_defaults(func=run, intermixed=True)  # overrides anywhere among the options


def design_record(prompt: str, room_path: str | None, seed: int):
    """The SceneRecord of one design request.

    `room_path`: a scene JSON (`scenegen.scene/1`; its prompt is replaced by `prompt`), a
    scene-set record (its scene; its requested items are not used), or a bare room object
    (`floor_polygon`, `wall_height`, ...); None = the bedroom the generator draws for
    DEFAULT_ROOM_SEED. `requested` is empty: the scene package has no prompt parser, so the
    judge grades prompt following from the prompt text alone. Raises SceneError naming the file.
    """
    from pydantic import ValidationError

    from jscenegen.scene.generator import make_record
    from jscenegen.scene.sceneset import SceneRecord, record_from_json
    from jscenegen.scene.schema import (
        Room,
        Scene,
        SceneError,
        first_error_line,
        read_json_file,
        scene_from_json,
    )
    from jscenegen.text import not_unicode

    if not prompt.strip():
        raise SceneError("--prompt is empty")
    if why := not_unicode(prompt):
        raise SceneError(f"--prompt: {why}")
    if room_path is None:
        room = make_record(DEFAULT_ROOM_SEED, "design").scene.room
        scene = Scene(scene_id="design", prompt=prompt, room=room)
    else:
        data = read_json_file(room_path, f"--room {room_path}")
        if isinstance(data, dict) and "scene" in data and "room" not in data:   # a scene-set record
            data = record_from_json(data, f"--room {room_path}").scene.to_json()
        if isinstance(data, dict) and "room" in data:
            scene = scene_from_json(data, f"--room {room_path}").model_copy(update={"prompt": prompt})
        else:
            try:
                room = Room.model_validate(data)
            except ValidationError as err:
                raise SceneError(first_error_line(err, f"--room {room_path}: not a scene or room",
                                                  "<room>")) from None
            scene = Scene(scene_id="design", prompt=prompt, room=room)
    return SceneRecord(scene, seed, ())


def _print_turn(message: dict) -> None:
    if message["role"] == "system":
        print(f"--- system prompt ({len(message['content'])} characters) ---", flush=True)
        return
    from jscenegen.text import terminal_text

    print(f"--- {message['actor']} ---\n{terminal_text(message['content'])}", flush=True)


def run(args) -> int:
    from jscenegen.paths import check_output_file, refuse_overwriting_input
    from jscenegen.run_config import config_inputs, load_run_config, warn_inert_settings
    from jscenegen.sharding.mesh import refuse_multi_host

    cfg = load_run_config(args.config, args.overrides, args.greedy, model_flag=True)
    refuse_multi_host("design", cfg.mesh)
    warn_inert_settings(cfg, sections=("judge",))   # the only conditional keys it reads
    check_output_file(args.out, "-o")
    inputs = {"--model": args.model, "--room": args.room, **config_inputs(cfg, args.config)}
    refuse_overwriting_input(args.out, "-o", inputs)
    if args.render:
        check_output_file(args.render, "--render", suffix=".png")
        refuse_overwriting_input(args.render, "--render", {**inputs, "-o": args.out})
    record = design_record(args.prompt, args.room, args.seed)

    from jscenegen.eval.evaluate import check_episode_fits, policy_chat, policy_engine, policy_mesh
    from jscenegen.eval.report import masked_scene_error
    from jscenegen.grpo.rollout.judges import build_judge, load_judge
    from jscenegen.paths import write_json
    from jscenegen.scene.metrics import measure
    from jscenegen.scene.reach_inputs import ReachabilityError
    from jscenegen.text import terminal_text

    # refuse what cannot work before the model loads: a room the runtime cannot measure, a
    # prompt that leaves the episode no room for a turn
    try:
        measure(record.scene, cfg.scene)
    except ReachabilityError as err:
        raise ReachabilityError(f"--room {args.room}: {err}" if args.room else str(err)) from None
    mesh = policy_mesh(cfg)
    judge = build_judge(cfg, mesh=mesh)   # a model judge: its files read, no weights yet
    judge.check_reachable()   # as eval and train do: before the model loads
    chat = policy_chat(cfg, args.model)
    check_episode_fits(chat, record, cfg)
    engine = policy_engine(cfg, args.model, chat=chat, mesh=mesh)
    load_judge(judge)   # a model judge's weights, beside the policy's
    episodes = {}

    def on_turn(member, message, episode) -> None:
        episodes[member] = episode
        _print_turn(message)

    group = engine.run_group(record, group_id=0, seeds=[args.seed], judge=judge,
                             scene_cfg=cfg.scene, judge_cfg=cfg.judge, on_turn=on_turn)
    traj = group.trajectories[0]
    scene = episodes[0].scene if 0 in episodes else record.scene  # no turn: the start failed
    out = Path(args.out)
    rendered_new = False
    if args.render:   # first: a render that fails (a full disk) leaves no scene file behind
        from jscenegen.scene.render import render_scene

        rendered_new = not Path(args.render).exists()
        render_scene(scene, args.render, cfg.scene)
    try:
        write_json(out, scene.to_json())
    except BaseException:
        if rendered_new:
            Path(args.render).unlink(missing_ok=True)
        raise
    print("--- result ---")
    print(json.dumps({"reward": None if traj.masked else traj.reward,
                      "failure_cause": traj.failure_cause,
                      "masked": traj.masked, "units": traj.units, "grades": traj.grades,
                      "metrics": traj.metrics, "objects": len(scene.objects), "scene": str(out),
                      "render": args.render}, indent=2, default=str))
    # the scene is written; a masked episode's reward is no measure of it (eval's rule)
    if why := masked_scene_error(traj.failure_cause, traj.masked, traj.failure_message,
                                 traj.outcome.get("judge_info", {}), out, cfg.judge):
        print(terminal_text(f"error: {why}"), file=sys.stderr)
        return 1
    return 0
