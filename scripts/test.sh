#!/usr/bin/env bash
# The test command: every crate's tests. CRIU tests skip visibly when CRIU is missing unless
# POSSUM_REQUIRE_CRIU=1; GPU tests skip visibly without a GPU unless POSSUM_REQUIRE_GPU=1.
# POSSUM_PROPTEST_CASES sets the number of property-test cases (default 256).
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo test --workspace "$@"
