"""Reproduce the shipped demo model, v6, from nothing: its whole lineage in one command.

    python scripts/reproduce_demo_model.py --out build/v6                  # 2 CPU cores: about 20 hours
    python scripts/reproduce_demo_model.py --out build/v6 --device cuda    # one GPU: about 50 minutes, half of it making data
    python scripts/reproduce_demo_model.py --list                          # every stage's commands

v6 was trained in nine stages across four sessions (docs/demo_model.md, runs 30-37a): run 30
from the factory's start (v3), a fine-tune with JSON answers and selection drills (run 32b,
v4), six fine-tunes that taught it to read the tools' descriptions (runs 36-36f, v5), and one
more of that recipe at scale (run 37a, v6). Each stage is ``train_demo_model.py`` (and, where
a stage's dialogues were topped up with JSON answers, ``demo_data.py`` first) with the options
the run used, starting from the stage before. ``--time-budget`` fitted the GPU stages' step
counts; they are written here as the counts it fitted, so a rerun follows the same schedules.

Resumable at two levels: the trainer resumes a stage from its checkpoints, and a stage that
finished (``<out>/<stage>/stage.json`` records its commands, ``final/`` holds its export) is
skipped. A stage directory holding other commands stops the run rather than mix recipes.
``--until`` stops after a stage (``--until run32b`` reproduces v4). The last stage's export
gets ``lineage.json``: the commands that made it, as the shipped v6 records its own.
``--smoke`` runs every stage at a few steps on a few dialogues, to check the chain, not to
train. On the same CPU and torch a stage comes out bit for bit (checked on run 36b); a GPU
run does not, and float results differ across torch versions and CPUs, so a rerun elsewhere
makes other weights and a model near v6's quality, not v6: runs 36-36f made again on a GPU
came out 8-12 points under v5 in exact arguments (docs/demo_model.md, run 41). Judge what it
makes with ``eval_demo_model.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
logger = logging.getLogger("reproduce_demo_model")


@dataclass(frozen=True)
class Stage:
    """One training run of the lineage: optional dialogues from ``demo_data.py``, then the trainer."""

    name: str  # the run's name in docs/demo_model.md, and its directory under --out
    train: dict  # trainer options: flag -> value, or True for a switch
    init_from: str | None = None  # the stage whose final/ this one starts from
    data: dict = field(default_factory=dict)  # demo_data.py options, when the run wrote its dialogues first
    ships_as: str | None = None  # the model version its final/ was released as


#: Selection-drill options of the v5 recipe (runs 36-36f).
_SEL = {"--selection-every-tool": True, "--selection-first-token": True, "--drill-every": 8, "--batch": 16}
_SEL_HALF = {**_SEL, "--selection-lexical": 0.5}
_LATE = {**_SEL_HALF, "--mix": "nonce_json2", "--n-dialogues": 10000, "--selection-every": 4,
         "--n-selections": 3000, "--steps": 700, "--lr": 1e-4}

LINEAGE = (
    # Prepared on CPU, trained on an H100; the lease ended at step 5,000 of the 8,116 fitted.
    Stage("run30", {"--mix": "nonce_json2", "--word-consistent-tokenizer": True, "--init": "hf", "--lr": 1e-3,
                    "--rope-theta": 10000, "--copy-warmup-steps": 800, "--lookup-steps": 400, "--drill-every": 12,
                    "--copy-warmup-until": 1.0, "--lookup-until": 3.0, "--lookup-max-steps": 1500,
                    "--intermediate-size": 1280, "--num-layers": 8, "--n-dialogues": 80000, "--batch": 32,
                    "--seed": 7, "--dialogue-steps": 6916, "--stop-after": 5000},
          ships_as="v3"),
    Stage("run32b", {"--selection-every": 3, "--n-selections": 20000, "--drill-every": 12, "--batch": 32,
                     "--seed": 3, "--lr": 5e-4, "--dialogue-steps": 3844},
          init_from="run30", ships_as="v4",
          data={"--n": 80000, "--seed": 7, "--mix": "nonce_json2", "--json-top-up": 6000, "--top-up-seed": 32}),
    Stage("run36", {**_SEL, "--n-dialogues": 200, "--selection-every": 1, "--selection-lexical": 1.0,
                    "--tools-description-first": True, "--n-selections": 16000, "--steps": 900, "--lr": 1e-3,
                    "--seed": 36},
          init_from="run32b"),
    Stage("run36b", {**_SEL_HALF, "--n-dialogues": 6000, "--selection-every": 2, "--n-selections": 4000,
                     "--steps": 300, "--lr": 3e-4, "--seed": 37},
          init_from="run36"),
    Stage("run36c", {**_SEL_HALF, "--mix": "nonce_json2", "--n-dialogues": 6000, "--selection-every": 3,
                     "--n-selections": 3000, "--steps": 280, "--lr": 1.5e-4, "--seed": 38},
          init_from="run36b"),
    Stage("run36d", {**_LATE, "--seed": 39}, init_from="run36c"),
    Stage("run36e", {**_LATE, "--seed": 40}, init_from="run36d"),
    Stage("run36f", {**_SEL_HALF, "--mix": "nonce_json3", "--n-dialogues": 6000, "--selection-every": 4,
                     "--n-selections": 2000, "--steps": 320, "--lr": 1e-4, "--seed": 41},
          init_from="run36e", ships_as="v5"),
    # Trained on an H200 (5 minutes 23 seconds); --time-budget 7.5 fitted the 4,032 steps.
    Stage("run37a", {**_SEL_HALF, "--selection-every": 4, "--n-selections": 16000, "--lr": 1e-4, "--seed": 43,
                     "--dialogue-steps": 4032},
          init_from="run36f", ships_as="v6",
          data={"--n": 40000, "--seed": 43, "--mix": "nonce_json2", "--json-top-up": 4000, "--top-up-seed": 44}),
)

#: --smoke: the same chain at a few steps on a few dialogues. The drill criteria go, since a
#: head cannot form in two steps and the trainer would stop at their caps.
_SMOKE_TRAIN = {"--n-dialogues": 24, "--n-selections": 12, "--batch": 4, "--steps": 2, "--dialogue-steps": 2,
                "--copy-warmup-steps": 1, "--lookup-steps": 1, "--stop-after": 3, "--copy-warmup-until": None,
                "--lookup-until": None, "--lookup-max-steps": None}
_SMOKE_DATA = {"--n": 24, "--json-top-up": 4}


def _smoke(options: dict, overrides: dict) -> dict:
    """``options`` with every flag it has that ``overrides`` names replaced (None: dropped)."""
    out = {k: overrides.get(k, v) for k, v in options.items()}
    return {k: v for k, v in out.items() if v is not None}


def _argv(options: dict) -> list[str]:
    return [part for flag, value in options.items()
            for part in ((flag,) if value is True else (flag, str(value)))]


def commands(stage: Stage, out: Path, extra: list[str], smoke: bool, scripts: Path = SCRIPTS) -> list[list[str]]:
    """The commands that make ``stage`` in ``out/stage.name``, as argument lists after the interpreter."""
    here = out / stage.name
    cmds = []
    if stage.data:
        data = _smoke(stage.data, _SMOKE_DATA) if smoke else stage.data
        cmds.append([str(scripts / "demo_data.py"), "--out", str(here / "data.jsonl"), *_argv(data)])
    train = _smoke(stage.train, _SMOKE_TRAIN) if smoke else dict(stage.train)
    if stage.init_from is not None:
        train["--init-from"] = str(out / stage.init_from / "final")
    if smoke:
        train["--max-len"] = 832  # a few dialogues: keep the long tool dialogues rather than run out
    cmds.append([str(scripts / "train_demo_model.py"), "--out", str(here), *_argv(train), *extra])
    return cmds


def recipe(stage: Stage, extra: list[str] = (), smoke: bool = False) -> list[str]:
    """``stage``'s commands as run from the repository root with the default ``--out``: the same
    wherever the repository and the output live."""
    return [shlex.join(["python", *cmd])
            for cmd in commands(stage, Path("build/v6"), list(extra), smoke, scripts=Path("scripts"))]


def lineage(stages=LINEAGE, extra: list[str] = (), smoke: bool = False) -> dict:
    """How a model was made, written beside its weights (``lineage.json``)."""
    return {"made_by": "scripts/reproduce_demo_model.py",
            "runs": [{"run": s.name, "ships_as": s.ships_as, "commands": recipe(s, extra, smoke)} for s in stages]}


def run_stage(stage: Stage, out: Path, extra: list[str], smoke: bool) -> bool:
    """Make ``stage`` unless it is done; False when it was done already."""
    here = out / stage.name
    cmds = commands(stage, out, extra, smoke)
    # The recipe, not the device or the precision: a run begun on a CPU may end on a GPU.
    made = {"recipe": recipe(stage, smoke=smoke), "commands": [shlex.join(["python", *c]) for c in cmds]}
    record = here / "stage.json"
    if record.exists() and (here / "final" / "model.safetensors").exists():  # else the trainer re-exports
        if json.loads(record.read_text())["recipe"] != made["recipe"]:
            raise SystemExit(f"{here} holds a stage made by other commands (see {record}): "
                             f"give another --out, or remove it to make it again")
        return False
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # every file is local; never fall back to the hub
    here.mkdir(parents=True, exist_ok=True)
    for cmd in cmds:
        if cmd[0].endswith("demo_data.py") and (here / "data.jsonl").exists():
            continue  # written whole or not at all (demo_data.write_jsonl)
        logger.info("%s: %s", stage.name, shlex.join(["python", *cmd]))
        try:
            subprocess.run([sys.executable, *cmd], check=True, env=env)
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"{stage.name} stopped (exit status {e.returncode}); run the same command again "
                             f"to go on from its last checkpoint") from None
    record.write_text(json.dumps(made, indent=1))
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("build/v6"), help="one directory per stage goes here")
    p.add_argument("--until", choices=[s.name for s in LINEAGE], default=LINEAGE[-1].name,
                   help="stop after this stage (run30: v3, run32b: v4, run36f: v5, run37a: v6)")
    p.add_argument("--device", default=None, help="torch device for every stage (e.g. cuda; default cpu)")
    p.add_argument("--bf16", action="store_true", help="train every stage under bfloat16 autocast (the trainer's "
                                                       "--bf16; the lineage itself trained in float32)")
    p.add_argument("--smoke", action="store_true", help="a few steps per stage: checks the chain, trains nothing")
    p.add_argument("--list", action="store_true", help="print every stage's commands and stop")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    extra = (["--device", args.device] if args.device else []) + (["--bf16"] if args.bf16 else [])
    stages = LINEAGE[:[s.name for s in LINEAGE].index(args.until) + 1]
    if args.list:
        for stage in stages:
            print(f"# {stage.name}" + (f" ({stage.ships_as})" if stage.ships_as else ""))
            for cmd in commands(stage, args.out, extra, args.smoke):
                print(shlex.join(["python", *cmd]))
        return 0
    for i, stage in enumerate(stages, 1):
        label = f"[{i}/{len(stages)}] {stage.name}" + (f" ({stage.ships_as})" if stage.ships_as else "")
        if run_stage(stage, args.out, extra, args.smoke):
            logger.info("%s: done", label)
        else:
            logger.info("%s: done before, skipped", label)
    last = stages[-1]
    final = args.out / last.name / "final"
    (final / "lineage.json").write_text(json.dumps(lineage(stages, extra, args.smoke), indent=1) + "\n")
    logger.info("%s is in %s", last.ships_as or last.name, final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
