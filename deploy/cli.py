"""The ``compactionrl`` command line: one subcommand per process of a run
(``replay``, ``learner``, ``actor``), ``up`` to run them all on one machine,
and the tools around them (``config``, ``model``, ``bootstrap``,
``evaluate``, ...); ``compactionrl --help`` lists them all. Each reads the
run's TOML (``--config``, composable) and ``--section.field`` overrides.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from deploy.config import ConfigError, describe_fields, load_config, to_toml
from deploy.fleet import Fleet, parse_fleet
from deploy.memory_plan import GIB
from deploy.model_shapes import FAMILIES, ModelShape, shape_of
from learner.config import LearnerConfig


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", action="append", default=None, metavar="FILE",
                        help="TOML file layered over the embedded "
                             "deploy/configs/local-cpu.toml; repeat to compose: later files "
                             "override earlier ones field by field (one naming a table's "
                             "factory replaces its options), then the --section.field overrides")


def _cmd_config_show(args: argparse.Namespace, overrides: list[str]) -> int:
    print(to_toml(load_config(args.config, overrides)), end="")
    return 0


def _cmd_config_fields(args: argparse.Namespace, overrides: list[str]) -> int:
    fields = describe_fields(values=load_config(args.config, overrides))
    if args.section:
        fields = [f for f in fields if f.name == args.section
                  or f.name.startswith(f"{args.section}.")]
        if not fields:
            sections = sorted({f.name.rsplit(".", 1)[0] for f in describe_fields()})
            print(f"compactionrl: no section or field {args.section!r}; sections: "
                  f"{', '.join(sections)}", file=sys.stderr)
            return 2
    for f in fields:
        print(f"{f.name}: {f.type} = {f.default}"
              + (f"  (field default: {f.field_default})" if f.field_default else ""))
        for line in f.doc.splitlines():
            print(f"    {line}")
    return 0


def _cmd_model_init(args: argparse.Namespace, overrides: list[str]) -> int:
    from starting_points.tiny_model import TinyModelConfig, build_tiny_model

    start = time.perf_counter()
    out = build_tiny_model(Path(args.out), TinyModelConfig(seed=args.seed))
    print(f"tiny model written to {out} in {time.perf_counter() - start:.1f} s")
    return 0


def _cmd_model_sample(args: argparse.Namespace, overrides: list[str]) -> int:
    from deploy.sample import sample

    config = load_config(args.config, overrides)
    return sample(args.model or config.run.model, config.actors.engine, prompt=args.prompt,
                  max_tokens=args.max_tokens, temperature=args.temperature,
                  num_prompts=args.num_prompts, check=args.check, as_json=args.json)


def _cmd_bootstrap(args: argparse.Namespace, overrides: list[str]) -> int:
    from starting_points.keyvault_bootstrap import bootstrap

    config = load_config(args.config, overrides)
    out = Path(args.out or config.run.model)
    report = bootstrap(out, config.actors, config.bootstrap)
    seconds = sum(report["seconds"].values())
    print(f"base policy written to {out} in {seconds:.0f} s (demonstrations succeed "
          f"{report['demonstrations']['success']:.1%}; recipe in {out / 'bootstrap.json'})")
    return 0


def _cmd_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    import dataclasses
    import json

    from deploy.evaluate import evaluate, format_report

    config = load_config(args.config, overrides)
    actors = config.actors
    actors.compaction.enabled = args.compaction == "on"
    if args.max_compactions is not None:
        actors.compaction.max_compactions = args.max_compactions
    models = [args.model or config.run.model] + ([args.baseline] if args.baseline else [])
    # the same held-out episodes for each: a folder named twice is evaluated once
    evaluated = {model: evaluate(model, actors, args.episodes, show_progress=sys.stderr.isatty(),
                                 group_size=args.group_size)
                 for model in dict.fromkeys(models)}
    reports = [evaluated[model].report for model in models]
    for report in reports:
        print(format_report(report))
    if args.baseline:
        trained, base = reports
        print(f"success {'compacted' if actors.compaction.enabled else 'single-window'}: "
              f"{base.success:.1%} ({base.model}) -> {trained.success:.1%} ({trained.model}), "
              f"{100 * (trained.success - base.success):+.1f} points")
    encoded = json.dumps(dataclasses.asdict(reports[0]) if not args.baseline else
                         {"trained": dataclasses.asdict(reports[0]),
                          "baseline": dataclasses.asdict(reports[1])})
    if args.out:
        out = Path(args.out)
        out.write_text(encoded + "\n")
        if out.name == "evaluation.json" and (out.parent / "metrics.jsonl").is_file():
            from deploy.viewer import write_held_out, write_viewer
            from ops.report import write_report

            # a run folder: its report shows the evaluation from now on, and
            # its viewer the same held-out tasks played by each policy
            roles = {"trained": models[0], **({"baseline": args.baseline} if args.baseline
                                              else {})}
            write_held_out(out.parent, {role: (model, evaluated[model].shown)
                                        for role, model in roles.items()})
            write_viewer(out.parent)
            write_report(out.parent, out.parent.name)
    if args.json:
        print(encoded)
    return 0


def _cmd_play(args: argparse.Namespace, overrides: list[str]) -> int:
    from deploy.play import play

    config = load_config(args.config, overrides)
    return play(args.model or config.run.model, config.actors, seed=args.seed,
                greedy=args.greedy, as_json=args.json, full=args.full)


def _cmd_actor(args: argparse.Namespace, overrides: list[str]) -> int:
    import asyncio
    import logging
    import os
    import socket

    from actors.engine import quiet_vllm_logging
    from actors.process import ActorSettings, run_actor
    from ops.timeline import close_timeline, open_timeline

    config = load_config(args.config, overrides)
    quiet_vllm_logging()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = ActorSettings(
        actor_id=args.actor_id or f"{socket.gethostname()}-actor-{args.index}",
        model=config.run.model, replay_address=args.replay or config.replay.actor_address,
        learner_address=None if args.no_learner else (args.learner
                                                      or config.learner.control_address),
        actor=config.actors, transport=config.transport, run_seed=config.run.seed,
        index=args.index, weight_timeout_s=config.learner.weight_timeout_s)
    # Said before the engine's slow start, so that an actor added by hand can be
    # stopped by its pid from the start.
    print(stop_hint(settings.actor_id, os.getpid()), flush=True)
    open_timeline(config.run_dir(), f"actor-{settings.actor_id}")
    try:
        return asyncio.run(run_actor(settings))
    finally:
        close_timeline()


def stop_hint(actor_id: str, pid: int) -> str:
    """What an actor says as it starts: its pid, and the command that stops
    it and only it. A signal to its pid, not a pattern over command lines:
    ``pkill -f`` also matches another actor whose id begins the same, and
    the shell or ssh session that runs the pattern."""
    return (f"actor {actor_id}: pid {pid}; to stop this actor alone: kill -TERM {pid} "
            "(it ends its episodes per actors.on_shutdown, flushes and says goodbye; "
            "an actor of `compactionrl up` is started again by up)")


def _cmd_replay(args: argparse.Namespace, overrides: list[str]) -> int:
    import json
    import logging
    import signal
    import threading

    from ops.timeline import close_timeline, open_timeline
    from replay.service import ReplayService

    config = load_config(args.config, overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    vocab_size = config.replay.vocab_size
    model_config = Path(config.run.model) / "config.json"
    if not vocab_size and model_config.is_file():
        vocab_size = json.loads(model_config.read_text())["vocab_size"]
    service = ReplayService(config.replay, config.transport, run_id=config.run.name,
                            vocab_size=vocab_size)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    open_timeline(config.run_dir(), "replay")
    try:
        service.serve(stop)
    finally:
        service.close()
        close_timeline()
    return 0


def _cmd_learner(args: argparse.Namespace, overrides: list[str]) -> int:
    import os

    import msgspec

    from learner.checkpoint import CheckpointNotFound, select_checkpoint
    from learner.settings import LearnerSettings
    from protocol.weights_collective import start_environments

    config = load_config(args.config, overrides)
    run_dir = config.run_dir()
    if args.resume:  # a wrong choice is told here, not by every rank under torchrun
        try:
            select_checkpoint(run_dir / "checkpoints", args.resume)
        except CheckpointNotFound as exc:
            print(f"compactionrl learner: --resume {args.resume}: {exc}", file=sys.stderr)
            return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    settings = LearnerSettings(model=config.run.model,
                               replay_address=config.replay.learner_address,
                               run_dir=str(run_dir), learner=config.learner,
                               transport=config.transport, resume=args.resume,
                               run_id=config.run.name,
                               trust_remote_code=config.actors.engine.trust_remote_code,
                               tracking=config.tracking)
    # a file per node: several nodes may share the run folder
    path = run_dir / (f"learner-settings-node{config.learner.node_rank}.json"
                      if config.learner.nnodes > 1 else "learner-settings.json")
    path.write_bytes(msgspec.json.encode(settings))
    command = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(config.learner),
               "-m", "learner", "--settings", str(path)]
    # torchrun takes over this process (and its signals); its ranks inherit
    # what rank 0's weight group needs from the start (torchrun passes the
    # error handling on instead of its own default)
    os.execve(command[0], command,
              {**os.environ, **start_environments(config.learner.weight_timeout_s).learner})


def torchrun_args(learner: LearnerConfig) -> list[str]:
    """torchrun's options for the learner: ``--standalone`` on one node; on
    ``learner.nnodes`` nodes, a static rendezvous at node 0
    (``learner.rdzv_endpoint``) with this node's ``learner.node_rank``, so
    that global rank 0, which binds the control socket and the weight store
    the actors dial, is on node 0. (c10d's dynamic rendezvous ranks nodes in
    the order of their descriptors, which would put rank 0 on any of them.)"""
    if learner.nnodes == 1:
        where = ["--standalone"]
    else:
        host, _, port = learner.rdzv_endpoint.rpartition(":")
        where = [f"--nnodes={learner.nnodes}", f"--node_rank={learner.node_rank}",
                 f"--master_addr={host.strip('[]')}", f"--master_port={port}"]
    return [*where, f"--nproc_per_node={learner.nproc}"]


def _cmd_up(args: argparse.Namespace, overrides: list[str]) -> int:
    import asyncio
    import json
    import os

    from actors.preflight import check_episode_setup
    from deploy.device_plan import plan_devices
    from deploy.placement import gpus_present
    from deploy.up import Up, prepare_model

    config = load_config(args.config, overrides)
    if args.fleet and (args.gpus is not None or args.gpu_memory_gib is not None):
        print("compactionrl: --fleet gives the GPUs and their sizes: leave out --gpus and "
              "--gpu-memory-gib", file=sys.stderr)
        return 2
    plan = plan_devices(config, _planned_fleet(args), args.model_shape)
    if args.plan:  # starts nothing
        # this machine's plan counts within up's own CUDA_VISIBLE_DEVICES; a preview's, not
        inherited = (os.environ.get("CUDA_VISIBLE_DEVICES")
                     if args.gpus is None and not args.fleet else None)
        if args.json:
            print(json.dumps(plan.to_json(inherited)))
            for problem in plan.problems:
                print(f"compactionrl: refused: {problem}", file=sys.stderr)
        else:  # the table ends with its reasons: said once, where the plan is read
            print(plan.table(inherited))
            if plan.problems:
                count = len(plan.problems)
                print(f"compactionrl: the plan is refused, for {count} "
                      f"reason{'s' if count != 1 else ''}: its REFUSED lines say which",
                      file=sys.stderr)
        return 2 if plan.problems else 0
    if args.fleet or (args.gpus is not None and args.gpus != gpus_present()):
        print("compactionrl: --gpus or --fleet only previews a plan (with --plan); up uses the "
              "GPUs present", file=sys.stderr)
        return 2
    if plan.problems:  # before the model is bootstrapped
        raise ConfigError(list(plan.problems))
    if config.learner.nnodes > 1:
        print(f"compactionrl: the learner spans {config.learner.nnodes} nodes; up starts node "
              f"0 here. On node K of the others run: compactionrl learner --config "
              f"{config.run_dir() / 'config.toml'} "
              "--learner.node_rank K", file=sys.stderr)
    prepare_model(config)
    if problems := config.model_problems():  # a model bootstrapped just now
        raise ConfigError(problems)
    # an environment, template or context budget that cannot run an episode,
    # told now rather than by each actor after its engine has started
    asyncio.run(check_episode_setup(config.run.model, config.actors))
    return Up(config, config.run_dir(), resume=args.resume,
              plan=plan).run()


def _planned_fleet(args: argparse.Namespace) -> Fleet:
    """The GPUs ``up`` plans for: ``--fleet``, or ``--gpus N`` of
    ``--gpu-memory-gib G`` (size unknown without it), or this machine's."""
    from deploy.placement import gpu_bytes, gpus_present

    if args.fleet:
        return args.fleet
    count = args.gpus if args.gpus is not None else gpus_present()
    size = (int(args.gpu_memory_gib * GIB) if args.gpu_memory_gib is not None
            else None if args.gpus is not None else gpu_bytes())
    return Fleet.uniform(count, size)


def _fleet_argument(text: str) -> Fleet:
    """``--fleet``'s value; argparse prints the message of a wrong one."""
    try:
        return parse_fleet(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _group_size_argument(text: str) -> int:
    """``eval --group-size``: a whole number of episodes per task, at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of episodes >= 1")
    return int(text)


def _gib_argument(text: str) -> float:
    """``--gpu-memory-gib``'s one size; several point to ``--fleet``."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not one size in GiB (e.g. 79.6); GPUs of several types: --fleet "
            "NAME=COUNTxGIB,... (e.g. h100=8x79.6,a100-40=8x39.4)") from None


def _shape_argument(text: str) -> ModelShape:
    """``--model-shape``'s value: a config.json, its folder, or a known family."""
    try:
        shape = shape_of(text)
    except (OSError, ValueError, KeyError) as exc:
        raise argparse.ArgumentTypeError(f"{text}: not a model's config.json ({exc!r})") from exc
    if shape is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a config.json, a folder holding one, nor a known family "
            f"({', '.join(FAMILIES)})")
    return shape


def _cmd_status(args: argparse.Namespace, overrides: list[str]) -> int:
    from deploy.up import status

    if args.run:
        return status(Path(args.run))
    config = load_config(args.config, overrides)
    return status(config.run_dir())


def _cmd_view(args: argparse.Namespace, overrides: list[str]) -> int:
    from deploy.viewer import write_viewer
    from learner.samples import SAMPLES_FOLDER

    run_dir = Path(args.run) if args.run else load_config(args.config, overrides).run_dir()
    if not (run_dir / SAMPLES_FOLDER).is_dir():
        print(f"{run_dir} holds no samples/ (the learner writes them as it trains)",
              file=sys.stderr)
        return 2
    page = write_viewer(run_dir)
    print(f"rollout viewer: {page}")
    if args.screenshot:
        from ops.browser import screenshot

        try:
            print(f"screenshot: {screenshot(page, Path(args.screenshot))}")
        except RuntimeError as error:  # no Chromium, or it failed: say which
            print(f"no screenshot: {error}", file=sys.stderr)
            return 1
    return 0


def _cmd_dashboards_export(args: argparse.Namespace, overrides: list[str]) -> int:
    from ops.observability import write_dashboards, write_files

    config = load_config(args.config, overrides)
    out = Path(args.dir)
    written = (write_files(out, **config.observability_files(out)) if args.all
               else write_dashboards(out))
    for path in written:
        print(path)
    return 0


def _cmd_dashboards_promql(args: argparse.Namespace, overrides: list[str]) -> int:
    from ops.observability import alert_rules, panel_queries

    thresholds = load_config(args.config, overrides).alert_thresholds()
    for where, series in panel_queries(args.run, args.range).items():
        print(where)
        for legend, expr in series:
            print(f"  {legend}: {expr}")
    print("Alerts (the thresholds of --config's run)")
    for rule in alert_rules(thresholds)["groups"][0]["rules"]:
        print(f"  {rule['alert']} (for {rule['for']}): {rule['expr']}")
    return 0


def _cmd_dashboards_push(args: argparse.Namespace, overrides: list[str]) -> int:
    from grafana_client import GrafanaApi

    from ops.observability import dashboards

    api = GrafanaApi.from_url(args.url, credential=args.token)
    folder = api.folder.create_folder("CompactionRL") if args.create_folder else None
    for stem, model in dashboards().items():
        api.dashboard.update_dashboard({"dashboard": model, "overwrite": True,
                                        **({"folderUid": folder["uid"]} if folder else {})})
        print(f"pushed {stem} to {args.url}")
    return 0


def _cmd_keys_init(args: argparse.Namespace, overrides: list[str]) -> int:
    from protocol.transport import generate_keys

    names = ["server"] + [f"client-{i}" for i in range(args.clients)]
    paths = generate_keys(Path(args.dir), names)
    for name, (public, secret) in paths.items():
        print(f"{name}: public {public}, secret {secret}")
    print(f"authorized client keys: {Path(args.dir) / 'authorized'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compactionrl",
        description="RL for LLM agents with context compaction as a trained action.",
        epilog="Configuration overrides go after the options: --section.field VALUE.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    config = commands.add_parser("config", help="inspect the configuration")
    config_sub = config.add_subparsers(dest="action", required=True)
    show = config_sub.add_parser(
        "show", help="print the effective configuration as TOML",
        epilog="Overrides: --section.field VALUE (every field: compactionrl config fields).")
    _config_args(show)
    show.set_defaults(handler=_cmd_config_show)
    fields = config_sub.add_parser(
        "fields", help="list every configuration field with its type, the value a run gets "
                       "(with --config: those files') and its meaning")
    _config_args(fields)
    fields.add_argument("section", nargs="?", default=None,
                        help="only this section or field, e.g. learner or actors.engine")
    fields.set_defaults(handler=_cmd_config_fields)

    model = commands.add_parser("model", help="build and try models")
    model_sub = model.add_subparsers(dest="action", required=True)
    init = model_sub.add_parser("init", help="write the tiny model (no network, seconds)")
    init.add_argument("--out", required=True, help="output folder")
    init.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    init.set_defaults(handler=_cmd_model_init)

    sample = model_sub.add_parser(
        "sample", help="generate from a model with vLLM (the actors' engine settings)")
    _config_args(sample)
    sample.add_argument("--model", default=None, help="model folder (default: run.model)")
    sample.add_argument("--prompt", default="open the door of room three and read the note",
                        help="user message, rendered with the model's chat template")
    sample.add_argument("--max-tokens", type=int, default=32)
    sample.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    sample.add_argument("--num-prompts", type=int, default=16,
                        help="copies of the prompt generated as one batch (throughput)")
    sample.add_argument("--check", action="store_true",
                        help="compare the engine's log-probabilities with transformers; "
                             "exit 1 on disagreement")
    sample.add_argument("--json", action="store_true", help="last line: one JSON object")
    sample.set_defaults(handler=_cmd_model_sample)

    boot = commands.add_parser(
        "bootstrap", help="fine-tune the tiny model on keyvault demonstrations whose summaries "
                          "are imperfect (the recipe: [bootstrap]): the base policy for RL")
    _config_args(boot)
    boot.add_argument("--out", default=None, help="output folder (default: run.model)")
    boot.set_defaults(handler=_cmd_bootstrap)

    evaluation = commands.add_parser(
        "eval", help="success rate (95%% CI) and compaction statistics on held-out episodes")
    _config_args(evaluation)
    evaluation.add_argument("--model", default=None, help="model folder (default: run.model)")
    evaluation.add_argument("--episodes", type=int, default=200)
    evaluation.add_argument("--compaction", choices=("on", "off"), default="on",
                            help="off: one window; the episode ends when it is full")
    evaluation.add_argument("--max-compactions", type=int, default=None,
                            help="default: actors.compaction.max_compactions")
    evaluation.add_argument("--group-size", type=_group_size_argument, default=1,
                            help="episodes per held-out task, each sampled apart (as GRPO's "
                                 "groups): the report adds how unequally a task's episodes "
                                 "compacted")
    evaluation.add_argument("--baseline", default=None,
                            help="also evaluate this model on the same episodes and print "
                                 "the change (e.g. the base policy before training)")
    evaluation.add_argument("--out", default=None,
                            help="also write the JSON report here; as RUN/evaluation.json of "
                                 "a run folder, the run's report.html shows it")
    evaluation.add_argument("--json", action="store_true", help="last line: one JSON object")
    evaluation.set_defaults(handler=_cmd_eval)

    play = commands.add_parser(
        "play", help="run one episode with compaction on the actors' engine and show it")
    _config_args(play)
    play.add_argument("--model", default=None, help="model folder (default: run.model)")
    play.add_argument("--seed", type=int, default=0, help="episode seed")
    play.add_argument("--greedy", action="store_true", help="temperature 0")
    play.add_argument("--json", action="store_true",
                      help="last line: one JSON object (each segment's whole text, the "
                           "reward's parts)")
    play.add_argument("--full", action="store_true",
                      help="show each segment whole, not only its end")
    play.set_defaults(handler=_cmd_play)

    up = commands.add_parser(
        "up", help="the whole run on this machine: replay, learner, actors, live view, report")
    _config_args(up)
    up.add_argument("--resume", action="store_true",
                    help="continue from the newest checkpoint in the run folder")
    up.add_argument("--plan", action="store_true",
                    help="print which GPUs, ports and weight transport each process would get, "
                         "and start nothing (exit 2 if the plan is refused)")
    up.add_argument("--gpus", type=int, default=None, metavar="N",
                    help="with --plan: plan for a machine with N GPUs (default: this one's)")
    up.add_argument("--gpu-memory-gib", type=_gib_argument, default=None, metavar="G",
                    help="with --plan: each GPU's memory, for the memory arithmetic "
                         "(default: this machine's; an H100 80GB reports 79.6)")
    up.add_argument("--fleet", type=_fleet_argument, default=None,
                    metavar="NAME=COUNTxGIB[,...]",
                    help="with --plan: plan for GPUs of several types, each a count of one "
                         "size in GiB, indices counting across them in this order, e.g. "
                         "h100=8x79.6,a100-40=8x39.4 (instead of --gpus and --gpu-memory-gib)")
    up.add_argument("--model-shape", type=_shape_argument, default=None,
                    metavar="CONFIG_JSON|FAMILY",
                    help="with --plan: the model's shape for the memory arithmetic, without "
                         "its weights: a config.json, a folder holding one, or a family ("
                         + ", ".join(FAMILIES) + "; default: run.model's config.json)")
    up.add_argument("--json", action="store_true", help="with --plan: one JSON object")
    up.set_defaults(handler=_cmd_up)

    status = commands.add_parser(
        "status", help="summary of a running or finished run (exit 0: it runs, or ended as "
                       "asked; 1: it failed or up was killed; 2: no run folder)")
    _config_args(status)
    status.add_argument("--run", default=None,
                        help="run folder (default: run.out_dir/run.name of the config)")
    status.set_defaults(handler=_cmd_status)

    view = commands.add_parser(
        "view", help="the rollout viewer: RUN/viewer.html, the rollouts the learner kept with "
                     "each token's advantage, weights and lag, one page that opens offline")
    _config_args(view)
    view.add_argument("--run", default=None,
                      help="run folder (default: run.out_dir/run.name of the config)")
    view.add_argument("--screenshot", default=None, metavar="PNG",
                      help="also draw the page in headless Chromium (deploy/install-chromium.sh "
                           "installs Debian's) into PNG: to look at a run without a desktop")
    view.set_defaults(handler=_cmd_view)

    boards = commands.add_parser("dashboards", help="Grafana dashboards generated from ops/")
    boards_sub = boards.add_subparsers(dest="action", required=True)
    export = boards_sub.add_parser("export", help="write the dashboards' JSON into DIR")
    export.add_argument("dir")
    export.add_argument("--all", action="store_true",
                        help="also the Prometheus config, alert rules and Grafana provisioning "
                             "(what deploy/observability holds), for the run's --config: its "
                             "metrics ports, its alert thresholds (staleness bound) and its "
                             "actors, those listed in RUN/prometheus/actor-targets.json as "
                             "they register (named relative to DIR)")
    _config_args(export)
    export.set_defaults(handler=_cmd_dashboards_export)
    promql = boards_sub.add_parser(
        "promql", help="print each panel's queries as plain PromQL (for Prometheus's own UI "
                       "or API: Grafana's variables filled in), then the alert rules")
    promql.add_argument("--run", default=None, metavar="NAME",
                        help="the run's name (run.name, the run label; default: every run)")
    promql.add_argument("--range", default="1m", metavar="DURATION",
                        help="the rates' window, in place of Grafana's $__rate_interval")
    _config_args(promql)
    promql.set_defaults(handler=_cmd_dashboards_promql)
    push = boards_sub.add_parser("push", help="upload the dashboards through Grafana's HTTP API")
    push.add_argument("--url", required=True, help="Grafana base URL, e.g. http://grafana:3000")
    push.add_argument("--token", required=True, help="a service-account token")
    push.add_argument("--create-folder", action="store_true",
                      help="create a CompactionRL folder and put them there")
    push.set_defaults(handler=_cmd_dashboards_push)

    actor = commands.add_parser(
        "actor", help="run one actor: episodes on a vLLM engine, segments to the replay")
    _config_args(actor)
    actor.add_argument("--replay", default=None,
                       help="replay address (default: replay.actor_address)")
    actor.add_argument("--learner", default=None,
                       help="learner control address (default: learner.control_address)")
    actor.add_argument("--no-learner", action="store_true",
                       help="never take weight updates (generate with run.model only)")
    actor.add_argument("--index", type=int, default=0,
                       help="this actor's index on the machine (metrics port and seed offset)")
    actor.add_argument("--actor-id", default=None,
                       help="stable id across restarts (default: HOST-actor-INDEX)")
    actor.set_defaults(handler=_cmd_actor)

    replay = commands.add_parser(
        "replay", help="run the replay service: segment ingest, rollout assembly, batches")
    _config_args(replay)
    replay.set_defaults(handler=_cmd_replay)

    learner = commands.add_parser(
        "learner", help="run the learner under torchrun (learner.nproc ranks, FSDP2)")
    _config_args(learner)
    learner.add_argument("--resume", nargs="?", const="latest", default="",
                         metavar="STEP|PATH",
                         help="continue from a checkpoint of the run folder: the newest "
                              "(alone), the one of STEP, or the checkpoint folder PATH")
    learner.set_defaults(handler=_cmd_learner)

    keys = commands.add_parser("keys", help="CURVE keys for authenticated sockets")
    keys_sub = keys.add_subparsers(dest="action", required=True)
    keys_init = keys_sub.add_parser("init", help="write a server key pair and client key pairs")
    keys_init.add_argument("dir", help="output folder")
    keys_init.add_argument("--clients", type=int, default=1, help="client key pairs to make")
    keys_init.set_defaults(handler=_cmd_keys_init)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)
    if overrides and not hasattr(args, "config"):
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    from actors.envs.base import EnvironmentLoadError
    from actors.preflight import SetupError
    from ops.metrics import PortInUse

    try:
        return args.handler(args, overrides)
    except (ConfigError, EnvironmentLoadError, SetupError, FileNotFoundError, PortInUse) as exc:
        print(f"compactionrl: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
