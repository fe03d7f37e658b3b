#!/usr/bin/env bash
# Who writes a migrated job's private memory into CRIU's images, A/B in one device call (under
# DUMP_PAGES_LIMIT_S, default 420 s), one GPU, both ends on it over loopback, images on a
# huge-page tmpfs: `POSSUM_DUMP_PAGES=criu` (CRIU as it dumps, one thread) against `possum` (the
# default: possum after CRIU's lazy dump, from several threads), taking turns, DUMP_PAGES_ROUNDS
# (2) rounds of:
#   - GPT-2 generation migrated alone at a random step (`gpu-ckpt.sh correctness`, one trial,
#     bit-exact against a run without possum);
#   - the job with 8 GiB of frozen weights and 64 MiB of state (`gpu-speculation.sh bars`).
# Builds nothing: carry .gpu, staged by `bash scripts/gpu-ckpt.sh --stage`.
# -> $OUT/dump-pages-gpt2.jsonl (each row's migrate.source has criu_dump_ms, criu_pages_read_ms,
#    criu_post_dump_at_ms), $OUT/dump-pages-f8.jsonl (rows tagged f8-criu, f8-possum),
#    $OUT/dump-pages-logs.tgz. Without a GPU it says SKIPPED and exits 0.
set -u
cd "$(dirname "$0")/.."
source scripts/gpu-start.sh
harness_run dump-pages DUMP_PAGES_LIMIT_S
bars_out=dump-pages-f8.jsonl
for round in $(seq "${DUMP_PAGES_ROUNDS:-2}"); do
    for pages in criu possum; do
        [ "$(left)" -gt 90 ] || break 2
        echo "== round $round, pages by $pages, $(left) s left"
        POSSUM_DUMP_PAGES=$pages migrations "gpt2-$round-$pages" 120 gpt2 1 1 $(( 200 + round )) \
            possum-keeper-migrate
        cat "$res/gpt2-$round-$pages/ckpt-correctness.jsonl" >> "$out/dump-pages-gpt2.jsonl" 2>/dev/null
        grep "^correctness (" "$res/gpt2-$round-$pages.log"
        POSSUM_DUMP_PAGES=$pages spec_bars "f8-$round-$pages" 55 SPEC_BARS="8 64 f8-$pages"
    done
done
(cd "$res" && find . -type f \( -name '*.log' -o -name '*.err' -o -name '*.md' \) -size -20M \
    | tar czf "$out/dump-pages-logs.tgz" -T -)
echo "== done, $(left) s left"
