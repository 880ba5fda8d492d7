"""Names and current versions of the record schemas, and the definitions that a field's meaning depends on.

Writers stamp these names; `record_migrations` brings older versions up to them; the reports read only
these. The fields of each schema are listed in reports/schemas.py.
"""

from __future__ import annotations

DECODE = "locks.bench.decode/2"
KERNEL = "locks.bench.kernel/1"
EVAL = "locks.eval/1"
MICROSCOPE = "locks.microscope/1"
CURRENT_SCHEMAS: tuple[str, ...] = (DECODE, KERNEL, EVAL, MICROSCOPE)

# `build_ms` is published only when the first prefill after a decode exceeds the steady mean by this many sd.
BUILD_SD_MULTIPLE = 3.0

# What a decode record's `step_floor_ms` counts (`step_floor_basis`): weights + attention bytes as recorded,
# weights computed from the cell's model preset (version 1 records), or the attention bytes alone because
# nothing else is known (`step_floor_why` says what was missing).
FLOOR_RECORDED, FLOOR_PRESET, FLOOR_KV_ONLY = "recorded", "preset", "kv_only"
