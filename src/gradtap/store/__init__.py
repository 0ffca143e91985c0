"""Run store: per-step statistics appended to a run directory that survives a crash.

A run directory holds ``run.db`` (an SQLite catalogue: metadata, series, histograms, the index
of the compacted chunks), ``values.f64`` (the statistics, series-major, in chunks of steps)
and, while a run is being written, ``rows-NNNNNN.log`` (the steps not compacted yet, appended
step-major). The layout is in ``docs/run-store.md``. The writer (the
:class:`~gradtap.Monitor`) appends one record per computed step, so a process killed at any
moment leaves every completed step readable; :func:`open_run` returns a read-only
:class:`Run` over it (stores of the older, all-SQLite schema included).
"""

from gradtap.store._common import (
    ALL_STAT_NAMES,
    APPLICATION_ID,
    DB_NAME,
    HEALTH_KIND,
    HEALTH_NAMES,
    KIND_NAMES,
    NO_HISTOGRAMS,
    SCHEMA_VERSION,
    STORED_KINDS,
    Histogram,
    build_frame,
    filter_series,
    import_pandas,
    missing_message,
    series_kind,
    writer_identity,
)
from gradtap.store._reader import Run, open_run
from gradtap.store._writer import RunWriter, set_run_meta

# The last names are shared with the Monitor's in-memory history (the same filters, frames and
# messages).
__all__ = ["DB_NAME", "SCHEMA_VERSION", "Histogram", "Run", "RunWriter", "open_run",
           "set_run_meta", "ALL_STAT_NAMES", "APPLICATION_ID", "HEALTH_KIND", "HEALTH_NAMES",
           "KIND_NAMES", "NO_HISTOGRAMS", "STORED_KINDS", "build_frame", "filter_series",
           "import_pandas", "missing_message", "series_kind", "writer_identity"]
