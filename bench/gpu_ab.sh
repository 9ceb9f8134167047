#!/usr/bin/env bash
# Source trees of this project timed on one GPU machine, alternately:
#   bash bench/gpu_ab.sh DIR DIR [DIR...] [ROUNDS] [bench/gpu.py options...]
# e.g. a base tree from `git archive BASE | tar -x -C DIR`. Lent machines differ by a
# microsecond or two a decode step from one lease to the next, so a change is to be
# compared with its base on the same machine, in one call; a prefill's lone-call
# medians still move by tenths of a millisecond between trees, so read its
# *_kernel_sum_ms (the device's busy time) beside them. Each tree is built with
# `pip install --target` into a folder of its own (its build needs meson-python
# importable, e.g. through PYTHONPATH), the builds side by side, and runs its own
# bench/gpu.py; every output line is prefixed with the tree's name. Default options:
# --only decode. With AB_JSON set to a folder, each run also writes its results there
# as NAME-ROUND.json (per-kernel tables included); with AB_TIMEOUT, each run is
# stopped after that many seconds; with AB_PYTEST set to pytest arguments, a copy of
# the last tree's tests/ then runs against its build. With AB_KEEP set to a folder, the
# builds are kept there, and a tree already built there is not built again: a second
# call on the still-warm machine skips the builds (about 130 s).
set -euo pipefail
trees=()
while [ $# -gt 0 ] && [ -d "$1" ]; do
    trees+=("$(cd "$1" && pwd)")
    shift
done
[ ${#trees[@]} -ge 2 ] || { echo "usage: $0 DIR DIR [DIR...] [ROUNDS] [options]" >&2; exit 2; }
rounds=2
if [[ ${1:-} =~ ^[0-9]+$ ]]; then
    rounds=$1
    shift
fi
opts=("$@")
[ ${#opts[@]} -gt 0 ] || opts=(--only decode)
if [ -n "${AB_KEEP:-}" ]; then
    work=$(mkdir -p "$AB_KEEP" && cd "$AB_KEEP" && pwd)
else
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
fi
jobs_=0
for t in "${trees[@]}"; do  # side by side: each build is one single-threaded nvcc
    n=$(basename "$t")
    [ ! -d "$work/$n/mamba" ] || continue  # kept from an earlier call (AB_KEEP)
    python3 -m pip install -q --no-build-isolation --no-deps --no-index \
        --target "$work/$n" "$t" > "$work/$n.log" 2>&1 &
    jobs_=$((jobs_ + 1))
done
for _ in $(seq "$jobs_"); do
    wait -n || { cat "$work"/*.log >&2; exit 1; }
done
for t in "${trees[@]}"; do  # an editable install elsewhere could shadow the tree's build
    n=$(basename "$t")
    got=$(cd "$work" && PYTHONPATH="$work/$n${PYTHONPATH:+:$PYTHONPATH}" \
          python3 -c "import mamba; print(mamba.__file__)")
    [[ $got == "$work/$n/"* ]] || { echo "$n: mamba imports from $got" >&2; exit 1; }
done
limit=()
[ -z "${AB_TIMEOUT:-}" ] || limit=(timeout "$AB_TIMEOUT")
for r in $(seq "$rounds"); do
    for t in "${trees[@]}"; do
        n=$(basename "$t")
        json=()
        [ -z "${AB_JSON:-}" ] || json=(--json "$AB_JSON/$n-$r.json")
        (cd "$work" && PYTHONPATH="$work/$n${PYTHONPATH:+:$PYTHONPATH}" \
            "${limit[@]}" python3 "$t/bench/gpu.py" "${opts[@]}" "${json[@]}" 2>&1 |
            grep -v -i warn | sed "s/^/$n /") || echo "$n: round $r stopped"
    done
done
if [ -n "${AB_PYTEST:-}" ]; then
    t=${trees[-1]}
    n=$(basename "$t")
    rm -rf "$work/tests-$n"
    cp -r "$t/tests" "$work/tests-$n"
    (cd "$work/tests-$n" && eval "PYTHONPATH=\"$work/$n\${PYTHONPATH:+:\$PYTHONPATH}\" \
        ${limit[*]} python3 -m pytest -p no:cacheprovider $AB_PYTEST") 2>&1 | tail -30
fi
