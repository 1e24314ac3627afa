"""Where things live under a run's store prefix (pure key naming).

Checkpoints (written by :mod:`ckpt_service`)::

    steps/000000000120/data/float32/00003.<nonce>/...   zarr v3 array, one piece
    steps/000000000120/records/<attempt>/rank-00001.json  a writer's shard record (store gather)
    steps/000000000120/manifest.<token>.json            the manifest
    commits/000000000120.json                           create-only commit marker
    lease/master.json                                   checkpoint-master lease

A user of the service may keep other objects in the same store under other prefixes (the
plugin's are in :mod:`hvd_transient.store_keys`): retention and gc list and delete only under
``steps/`` and ``commits/``.

Commit markers live in their own small directory so that finding the committed
steps is one short listing, however many data objects the steps hold.

Shard records live under the save *attempt* that wrote them (an id every writer of one
save agrees on): a coordinator lists and reads only its own attempt's records, so the
records an abandoned attempt of the same step left behind can never be mixed into its commit.
"""
from __future__ import annotations

import re

from ckpt_service.errors import BadAttemptError, BadStepError

# ---- checkpoints --------------------------------------------------------------------------------

STEPS_PREFIX = "steps/"
COMMITS_PREFIX = "commits/"
LEASE_KEY = "lease/master.json"

#: a step is written as this many decimal digits in its keys, so that keys sort as steps do
STEP_DIGITS = 12
#: the first step that no longer fits those digits
STEP_LIMIT = 10 ** STEP_DIGITS
#: what a step looks like in a key: exactly STEP_DIGITS ASCII digits (str.isdigit would also take
#: '²' or Arabic-Indic digits, which int() refuses or reads as another step's key)
_STEP_TEXT = re.compile(rf"[0-9]{{{STEP_DIGITS}}}")


def step_prefix(step: int) -> str:
    if not 0 <= step < STEP_LIMIT:
        raise BadStepError(f"step {describe_int(step)} does not fit the store's keys: steps are integers from 0 "
                           f"to {STEP_LIMIT - 1} ({STEP_DIGITS} digits)")
    return f"{STEPS_PREFIX}{step:0{STEP_DIGITS}d}/"


def describe_int(value: int) -> str:
    """``value`` as a message shows it: a number too long to read is shown by its length (str()
    refuses to convert more than 4300 digits at all)."""
    if -STEP_LIMIT ** 2 < value < STEP_LIMIT ** 2:
        return str(value)
    try:
        digits = str(len(str(abs(value))))
    except ValueError:
        digits = "more than 4300"
    return f"{'-' if value < 0 else ''}<an integer of {digits} digits>"


def commit_key(step: int) -> str:
    step_prefix(step)  # validates
    return f"{COMMITS_PREFIX}{step:0{STEP_DIGITS}d}.json"


def parse_commit_key(key: str) -> int | None:
    """The step of a commit marker's key; None for any other name (a foreign object is ignored, never
    an error: anyone may drop a file into ``commits/``)."""
    name = key[len(COMMITS_PREFIX):]
    stem = name[: -len(".json")] if name.endswith(".json") else ""
    return parse_step_dir(stem)


def manifest_key(step: int, token: str) -> str:
    return step_prefix(step) + f"manifest.{token}.json"


#: what a save attempt id may be: one plain key segment (not '.' or '..'), short enough for any store
ATTEMPT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_attempt(attempt: str) -> str:
    """``attempt`` if it can name a save attempt in keys; BadAttemptError otherwise."""
    if not isinstance(attempt, str) or ATTEMPT_PATTERN.fullmatch(attempt) is None:
        raise BadAttemptError(
            f"save attempt id {attempt!r} is not usable in store keys: use 1 to 64 characters of "
            "letters, digits, '.', '_' and '-', starting with a letter or digit (e.g. 'ring3f2a-120-0')")
    return attempt


def records_prefix(step: int, attempt: str) -> str:
    """The directory of one save attempt's shard records."""
    return step_prefix(step) + f"records/{check_attempt(attempt)}/"


def record_key(step: int, attempt: str, rank: int) -> str:
    return records_prefix(step, attempt) + f"rank-{rank:05d}.json"


def piece_prefix(step: int, group: str, index: int, nonce: str) -> str:
    # The writer's nonce makes every attempt's keys unique: a late or zombie
    # writer can never overwrite bytes that a committed manifest points to.
    return step_prefix(step) + f"data/{group}/{index:05d}.{nonce}/"


def parse_step_dir(name: str) -> int | None:
    """The step a folder name of ``steps/`` stands for, as :func:`step_prefix` writes it; None otherwise."""
    return int(name) if _STEP_TEXT.fullmatch(name) else None
