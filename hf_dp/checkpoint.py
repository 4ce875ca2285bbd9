"""What a checkpoint holds for privacy, and the lock that keeps one run per `output_dir`.

Every checkpoint gets two files beside Trainer's:
- the ledger (`dp_ledger.json`, the same record that is saved beside the privacy card): the accountant's state
  and what ε is computed from;
- the resume state (`dp_resume.json`, never uploaded): the plan's fingerprint, the data secret that drew G and each
  user's rows, adaptive clipping's running C, and a digest over both files.

A resumed run continues only from a checkpoint whose two files are intact, match each other and Trainer's step,
and were written under the same privacy configuration: the ε already spent is never lost or rewritten.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass

import numpy as np
from filelock import FileLock, Timeout

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None
from safetensors import SafetensorError
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from . import accounting
from .accounting.floating_point import NOISE_REACH, TAIL_PER_DRAW
from .arguments import DPTrainingArguments
from .vocabulary import LEDGER_FILE
from .clipping.adaptive import QuantileTracker
from .privacy_plan import PrivacyPlan

logger = logging.getLogger(__name__)

RESUME_FILE = "dp_resume.json"  # in every checkpoint, never uploaded: it holds the data secret
LOCK_FILE = "_hf_dp.lock"  # in output_dir while a run trains there (never uploaded: `_*`)
INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"  # Trainer's just-in-time save removes it once complete
_RESUME_FORMAT = 1


def ledger_record(plan: PrivacyPlan, args: DPTrainingArguments, accountant: accounting.PrivacyAccountant) -> dict:
    """The ledger: what `hf-dp publish` recomputes ε from (accountant state, δ, privacy unit, mechanism, sampling)."""
    return {"format": 1, "delta": plan.delta, "privacy_unit": args.privacy_unit, "mechanism": plan.mechanism,
            "sampling": args.sampling if args.privacy_unit == "user" else None,
            "accountant": accountant.state_dict(),
            # what the noise sampler's finite support adds to δ: steps × draws_per_step draws of this tail each
            "noise": {"draws_per_step": plan.noise_draws_per_step, "tail_per_draw": TAIL_PER_DRAW,
                      "reach": NOISE_REACH}}


def write_checkpoint(folder: str, *, ledger: dict, fingerprint: dict, data_secret: str,
                     quantile_tracker: QuantileTracker | None) -> None:
    """Write the ledger and the resume state into a checkpoint folder, before Trainer's own files: a checkpoint whose
    `trainer_state.json` exists (Trainer writes it last) then holds its privacy state too.

    Raises:
        RuntimeError: the files cannot be written (e.g. a full disk); earlier checkpoints are untouched.
    """
    resume = {
        "format": _RESUME_FORMAT,
        "config": fingerprint,
        "data_secret": data_secret,  # a resumed run keeps G and the rows it chose; never released
        # adaptive clipping's running C: a resumed run clips where the checkpoint's would have
        "quantile_tracker": quantile_tracker.to_dict() if quantile_tracker is not None else None,
        "ledger_digest": digest(ledger),
    }
    resume["digest"] = digest({key: value for key, value in resume.items() if key != "digest"})
    try:
        os.makedirs(folder, exist_ok=True)
        _write_json(os.path.join(folder, LEDGER_FILE), ledger)
        _write_json(os.path.join(folder, RESUME_FILE), resume)
    except OSError as error:
        raise RuntimeError(f"Saving the privacy state of {folder} failed ({type(error).__name__}: {error}): the "
                           "checkpoint is incomplete and will not be resumed from; earlier checkpoints are intact. "
                           "Free disk space (or fix the folder's permissions) and resume.") from error


@dataclass
class SavedRun:
    """A checkpoint's privacy state, read and checked for integrity (not yet against this run's plan)."""

    folder: str
    config: dict
    accountant: accounting.PrivacyAccountant
    data_secret: str | None
    quantile_tracker: dict | None


def unfinished_shards(checkpoint: str) -> list[str]:
    """The sharded model and optimizer folders (FSDP2's `pytorch_model_fsdp_*`, `optimizer_*`) of a checkpoint that
    lack the `.metadata` file torch.distributed.checkpoint writes after every rank's shards."""
    return sorted(name for name in os.listdir(checkpoint)
                  if re.match(r"^(pytorch_model_fsdp|optimizer)_\d+$", name)
                  and os.path.isdir(os.path.join(checkpoint, name))
                  and not os.path.isfile(os.path.join(checkpoint, name, ".metadata")))


def read_checkpoint(checkpoint: str) -> SavedRun:
    """Read a checkpoint's ledger and resume state; check their digests and the step count against Trainer's.

    Raises:
        ValueError: one line naming the file: missing, unreadable, edited, or not matching its checkpoint.
    """
    ledger_path, resume_path = os.path.join(checkpoint, LEDGER_FILE), os.path.join(checkpoint, RESUME_FILE)
    if os.path.isfile(os.path.join(checkpoint, "dp_state.json")) and not os.path.isfile(resume_path):
        raise ValueError(f"{checkpoint} was written by an older hf_dp (dp_state.json): resume it with that version, "
                         "or start a new run.")
    if not os.path.isdir(checkpoint):
        raise ValueError(f"resume_from_checkpoint={checkpoint!r} does not exist: pass a checkpoint folder of this "
                         "output_dir, or True for the newest complete one.")
    if os.path.isfile(os.path.join(checkpoint, INCOMPLETE_MARKER)):
        raise ValueError(f"{checkpoint} is incomplete (Trainer's {INCOMPLETE_MARKER} is still there: the save was "
                         "interrupted); resume from an earlier checkpoint, or pass True for the newest complete one.")
    missing = [name for name in (LEDGER_FILE, RESUME_FILE, TRAINER_STATE_NAME)
               if not os.path.isfile(os.path.join(checkpoint, name))]
    if missing:
        raise ValueError(
            f"{checkpoint} is incomplete or was not written by a DP trainer: it has no {' or '.join(missing)} (an "
            "interrupted save leaves this). Resuming without its ledger would lose the ε already spent: resume from "
            "an earlier checkpoint, pass True for the newest complete one, or start a new run."
        )
    unfinished = unfinished_shards(checkpoint)
    if unfinished:
        raise ValueError(f"{checkpoint} is incomplete: its sharded state {' and '.join(unfinished)} has no .metadata "
                         "(torch.distributed.checkpoint writes it last, once every rank's shards are written: a rank "
                         "stopped during the save); resume from an earlier checkpoint, or pass True for the newest "
                         "complete one.")
    check_weight_files(checkpoint)
    ledger, resume = read_json(ledger_path, "the privacy ledger"), read_json(resume_path, "the resume state")
    if not isinstance(resume, dict) or not isinstance(resume.get("config"), dict) \
            or not isinstance(resume.get("digest"), str) or not isinstance(ledger, dict) \
            or not isinstance(ledger.get("accountant"), dict):
        raise ValueError(f"{resume_path} is not a DPTrainer resume state with 'config' and 'digest' beside a ledger "
                         "with 'accountant' (written by another hf_dp version, or edited): resume from a checkpoint "
                         "of this version or start a new run.")
    if resume["digest"] != digest({key: value for key, value in resume.items() if key != "digest"}):
        raise ValueError(f"{resume_path}: its integrity digest does not match its contents (edited or corrupted): "
                         "resume from an intact checkpoint or start a new run.")
    if resume.get("ledger_digest") != digest(ledger):
        raise ValueError(f"{ledger_path}: the ledger does not match the digest its resume state records (the ledger "
                         "was edited or corrupted): resume from an intact checkpoint or start a new run.")
    accountant = accounting.PrivacyAccountant()
    try:
        accountant.load_state_dict(ledger["accountant"])
    except ValueError as error:
        raise ValueError(f"{ledger_path}: {error}") from error
    state = read_json(os.path.join(checkpoint, TRAINER_STATE_NAME), "the trainer state")
    global_step = state.get("global_step") if isinstance(state, dict) else None
    if accountant.steps != global_step:
        raise ValueError(f"{ledger_path} records {accountant.steps} steps but its checkpoint is at global step "
                         f"{global_step} ({TRAINER_STATE_NAME}): the ledger does not match its checkpoint; resume "
                         "from an intact checkpoint or start a new run.")
    return SavedRun(checkpoint, dict(resume["config"]), accountant, resume.get("data_secret"),
                    resume.get("quantile_tracker"))


def stopped_rank_note(args) -> str:
    """What a rank of a multi-rank run says when its training stops on an error (its own, or a collective that
    failed or timed out because another rank stopped), and how to go on."""
    try:
        newest, _ = newest_complete_checkpoint(args.output_dir)
        resume = (f"relaunch with resume_from_checkpoint=True to go on from {newest}, the newest complete checkpoint, "
                  "with its ledger")
    except (ValueError, OSError):
        resume = "no complete checkpoint was saved: start again"
    return (f"rank {args.process_index} of {args.world_size} stopped training on the error below: if it is a "
            f"collective's (timed out after ddp_timeout={args.ddp_timeout} s, or a closed connection), another rank "
            f"stopped or stalled first (the launcher's log names it); {resume}.")


def check_weight_files(checkpoint: str) -> None:
    """Refuse a checkpoint whose safetensors weights are cut short (a save interrupted mid-file): each file's header
    must read and its tensors cover the file, checked from the header alone (nothing is loaded)."""
    from safetensors import safe_open

    for name in sorted(os.listdir(checkpoint)):
        if not name.endswith(".safetensors"):
            continue
        try:
            with safe_open(os.path.join(checkpoint, name), framework="pt"):
                pass
        except Exception as error:  # safetensors' own error type, or an OSError
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ValueError(f"{checkpoint} is incomplete: its weights {name} are truncated or corrupt ({reason}); "
                             "resume from an earlier checkpoint, or pass True for the newest complete one.") from None


def newest_complete_checkpoint(output_dir: str) -> tuple[str, list[str]]:
    """The newest checkpoint in `output_dir` whose privacy state reads and verifies, and why newer ones were skipped.

    Raises:
        ValueError: no checkpoint, or none complete (each one's reason listed).
    """
    pattern = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
    found = sorted(((int(m.group(1)), name) for name in (os.listdir(output_dir) if os.path.isdir(output_dir) else [])
                    if (m := pattern.match(name)) and os.path.isdir(os.path.join(output_dir, name))), reverse=True)
    if not found:
        raise ValueError(f"No valid checkpoint found in output directory ({output_dir}): nothing to resume from.")
    skipped = []
    for _, name in found:
        folder = os.path.join(output_dir, name)
        try:
            read_checkpoint(folder)
        except ValueError as error:
            skipped.append(f"{name}: {error}")
            continue
        return folder, skipped
    raise ValueError(f"No complete checkpoint in {output_dir} (each has a missing or unverifiable privacy state): "
                     + " | ".join(skipped))


# Fingerprint fields added after checkpoints were first written, with the value such a checkpoint trained under.
ADDED_FIELDS = {"redraw_rows": False}


def secret_to_resume(args: DPTrainingArguments) -> str | None:
    """The data secret of `args.resume_from_checkpoint` (read and verified before G is drawn), or None: a run that
    says where it resumes from draws G and the rows once, with the checkpoint's secret."""
    resume = args.resume_from_checkpoint
    if resume is None or resume is False or str(resume).lower() in ("", "false"):
        return None
    if resume is True or str(resume).lower() == "true":
        resume, _ = newest_complete_checkpoint(args.output_dir)
    return read_checkpoint(str(resume)).data_secret


def check_saved_run(saved: SavedRun, plan: PrivacyPlan, args: DPTrainingArguments) -> QuantileTracker | None:
    """Check a checkpoint's privacy state against this run's plan; return its adaptive clipping tracker (or None).

    Raises:
        ValueError: a different privacy configuration, a ledger whose steps were composed under another plan, or
            an adaptive clipping state that does not match.
    """
    if not any(name.startswith("optimizer") for name in os.listdir(saved.folder)):
        raise ValueError(f"{saved.folder} holds no optimizer state (saved with save_only_model=True): resuming would "
                         "restart the optimizer from scratch, so the run would differ from an uninterrupted one. "
                         "Resume from a full checkpoint, or start a new run from these weights.")
    if not os.path.isfile(os.path.join(saved.folder, SCHEDULER_NAME)):
        raise ValueError(f"{saved.folder} holds no scheduler state ({SCHEDULER_NAME}): resuming would restart the "
                         "learning rate schedule, so the run would differ from an uninterrupted one. Resume from a "
                         "complete checkpoint, or start a new run from these weights.")
    current = plan.fingerprint(args)
    saved_config = {**ADDED_FIELDS, **saved.config}  # a checkpoint from before a field existed had its default
    changed = {k: (saved_config.get(k), v) for k, v in current.items() if not same(saved_config.get(k), v)}
    steps = _saved_max_steps(saved.folder)
    follows_steps = {"noise_multiplier", "logging_noise_multiplier", "clipping_count_noise"}  # σ and what follows it
    if "noise_multiplier" in changed and set(changed) <= follows_steps and args.target_epsilon is not None \
            and steps not in (None, args.max_steps):
        sigma = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in changed.items())
        raise ValueError(f"Checkpoint {saved.folder} was trained for max_steps={steps}, this run plans "
                         f"max_steps={args.max_steps}: at target_epsilon={args.target_epsilon:g} the noise follows the "
                         f"number of steps ({sigma}), so the ledger would not stay true; resume with "
                         f"max_steps={steps} (and the same num_train_epochs), or start a new run.")
    if changed:
        if steps not in (None, args.max_steps):
            changed["max_steps"] = (steps, args.max_steps)
        details = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in changed.items())
        raise ValueError(f"Checkpoint {saved.folder} was trained under a different privacy configuration ({details}). "
                         "Resume with the same privacy arguments and data, or start a new run.")
    ledger_path = os.path.join(saved.folder, LEDGER_FILE)
    expected = (plan.sample_rate, plan.effective_noise_multiplier, plan.group_size)
    for i, segment in enumerate(saved.accountant.history):
        found = (segment["sample_rate"], segment["effective_noise_multiplier"], segment["group_size"])
        if not all(same(a, b) for a, b in zip(found, expected)):
            raise ValueError(f"{ledger_path}: segment {i} has (sample_rate, effective_noise_multiplier, group_size) = "
                             f"{found}, not this run's {expected}: the ledger does not match the plan; start a new run."
                             )
    _note_later_checkpoints(saved.folder)
    return _saved_tracker(saved, plan)


def _saved_max_steps(folder: str) -> int | None:
    """The `max_steps` Trainer saved in the checkpoint's `trainer_state.json` (None if unreadable)."""
    try:
        with open(os.path.join(folder, TRAINER_STATE_NAME), encoding="utf-8") as file:
            steps = json.load(file).get("max_steps")
    except (OSError, ValueError, AttributeError):
        return None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def _note_later_checkpoints(folder: str) -> None:
    """Resuming from an older checkpoint: what the abandoned later steps released (logs sent to `report_to`,
    later checkpoints shared) is outside the new ledger, which restarts from this checkpoint's."""
    pattern = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
    parent, name = os.path.split(os.path.normpath(folder))
    match = pattern.match(name)
    if match is None or not os.path.isdir(parent):
        return
    later = sorted(other for other in os.listdir(parent)
                   if (m := pattern.match(other)) and int(m.group(1)) > int(match.group(1)))
    if later:
        logger.warning("Resuming from %s although %s exist: whatever the later steps released (logs already sent "
                       "to report_to, checkpoints shared) is not in the resumed ledger, which continues from %s's. "
                       "Only the model trained from here on is covered by its card.", name, ", ".join(later), name)


def _saved_tracker(saved: SavedRun, plan: PrivacyPlan) -> QuantileTracker | None:
    path, state = os.path.join(saved.folder, RESUME_FILE), saved.quantile_tracker
    if plan.adaptive_clipping is None:
        if state is not None:
            raise ValueError(f"{path} holds an adaptive clipping state but its configuration says a fixed "
                             "clipping norm: the resume state is inconsistent; start a new run.")
        return None
    try:
        tracker = QuantileTracker.from_dict(state)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: no valid adaptive clipping state ({error}); resume from a checkpoint of this "
                         "version or start a new run.") from None
    found = (tracker.target_quantile, tracker.learning_rate, tracker.count_noise, tracker.steps)
    expected = (plan.adaptive_clipping.target_quantile, plan.adaptive_clipping.learning_rate, plan.count_noise,
                saved.accountant.steps)
    if not all(same(a, b) for a, b in zip(found, expected)):
        raise ValueError(f"{path}: its adaptive clipping state has (target_unclipped_quantile, "
                         f"clipping_learning_rate, clipping_count_noise, steps) = {found}, not this run's "
                         f"{expected}: the resume state does not match the plan; start a new run.")
    return tracker


class SaveFailed(OSError, RuntimeError):
    """A checkpoint that could not be written (an `OSError`, so commands print it as one line; a `RuntimeError` as
    before)."""


@contextlib.contextmanager
def failure_stated(folder: str):
    """Turn a failed save (a full disk, a lost mount; in torch.save or safetensors) into one line that says what is
    left usable."""
    try:
        yield
    except (OSError, RuntimeError, SafetensorError) as error:
        reason = " ".join(str(error).split())[:200]
        raise SaveFailed(f"Saving {folder} failed ({type(error).__name__}: {reason}): it is incomplete and will not "
                         "be resumed from; earlier checkpoints are intact.") from error


class OutputDirInUse(OSError, RuntimeError):
    """Another live run holds `output_dir`'s lock (an `OSError`, so commands print it as one line)."""


@contextlib.contextmanager
def output_dir_lock(output_dir: str, enabled: bool = True):
    """Hold an exclusive lock on `output_dir/_hf_dp.lock` while one run writes there; the file is removed after.

    The OS releases the lock when the process ends, even if it crashes: a leftover file does not block a later run.
    A run that finds the file removed between opening and locking it (the previous run ending) opens it again.

    Raises:
        OutputDirInUse (a RuntimeError and an OSError): another live run holds the lock.
    """
    if not enabled:
        yield
        return
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, LOCK_FILE)
    busy = (f"output_dir={output_dir!r} is in use by another live training run ({path} is locked): wait for it to "
            "finish or choose another --output_dir.")
    if fcntl is None:  # pragma: no cover - not POSIX: filelock's lock, its file left in place
        lock = FileLock(path, timeout=0)
        try:
            lock.acquire()
        except Timeout:
            raise OutputDirInUse(busy) from None
        try:
            yield
        finally:
            lock.release()
        return
    fd = _lock_file(path, busy)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # while still held, so no later run locks a removed file
        os.close(fd)  # releases the lock


def _lock_file(path: str, busy: str) -> int:
    """A descriptor of `path` holding its exclusive lock (the file at `path` now, not one removed meanwhile)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # BlockingIOError: held by a live run
            os.close(fd)
            raise OutputDirInUse(busy) from None
        try:
            held, current = os.fstat(fd), os.stat(path)
            if (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # the run that held it removed it on finishing: lock the new one


def read_json(path: str, what: str):
    """A JSON file of a checkpoint or output folder, or one clear `ValueError` saying it is unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path}: cannot read {what} ({type(error).__name__}: {error}); the file is truncated "
                         "or corrupted: resume from an intact checkpoint or start a new run.") from error


def same(a, b) -> bool:
    """Equal, floats to 1e-9 relative (a value that went through JSON)."""
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and bool(np.isclose(a, b, rtol=1e-9, atol=0))
    return a == b


def digest(content: dict) -> str:
    """sha256 of the canonical JSON (catches edits and corruption)."""
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _write_json(path: str, content: dict) -> None:
    """Write to a temporary file, then rename: a crash leaves the old file or the new one, never half of one."""
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(content, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, temporary[: -len(".tmp")])
