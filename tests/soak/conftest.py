"""The soak suite runs like tests/mpi: the same ``comm`` fixture, per-test
barrier and abort-on-failure hook, taken from tests/mpi/conftest.py rather than
copied. ``make soak`` runs it through the same runner
(``WAGMA_TEST_DIR=tests/soak mpiexec -n 8 python tests/mpi/run.py``: rank 0
reports); ``mpiexec -n N python -m pytest tests/soak`` works too (every rank
reports). Not part of ``make test``: run.py collects tests/mpi by default.
"""

from __future__ import annotations

import importlib.util
import os
import sys

_MPI_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpi")
sys.path.insert(0, _MPI_TESTS)  # stresslib, shared with tests/mpi/test_stress.py

_spec = importlib.util.spec_from_file_location("wagma_tests_mpi_conftest",
                                               os.path.join(_MPI_TESTS, "conftest.py"))
assert _spec is not None and _spec.loader is not None
_mpi_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mpi_conftest)

pytest_runtest_logreport = _mpi_conftest.pytest_runtest_logreport
comm = _mpi_conftest.comm
_in_step = _mpi_conftest._in_step
