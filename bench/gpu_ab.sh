#!/usr/bin/env bash
# Two source trees of this project timed on one GPU machine, alternately:
#   bash bench/gpu_ab.sh A_DIR B_DIR [ROUNDS] [bench/gpu.py options...]
# e.g. A_DIR from `git archive BASE | tar -x -C A_DIR`. Lent machines differ by a
# microsecond or two a decode step from one lease to the next, so a change is to be
# compared with its base on the same machine, in one call. Each tree is built with
# `pip install --target` into a folder of its own (its build needs meson-python
# importable, e.g. through PYTHONPATH) and runs its own bench/gpu.py; every output
# line is prefixed with the tree's name. Default options: --only decode. With
# AB_JSON set to a folder, each run also writes its results there as NAME-ROUND.json
# (per-kernel tables included).
set -euo pipefail
a=$(cd "$1" && pwd) b=$(cd "$2" && pwd)
rounds=${3:-2}
shift $(( $# < 3 ? $# : 3 ))
opts=("$@")
[ ${#opts[@]} -gt 0 ] || opts=(--only decode)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for t in "$a" "$b"; do  # side by side: each build is one single-threaded nvcc
    python3 -m pip install -q --no-build-isolation --no-deps --no-index \
        --target "$work/$(basename "$t")" "$t" > "$work/$(basename "$t").log" 2>&1 &
done
for t in "$a" "$b"; do
    wait -n || { cat "$work"/*.log >&2; exit 1; }
done
for t in "$a" "$b"; do  # an editable install elsewhere could shadow the tree's build
    n=$(basename "$t")
    got=$(cd "$work" && PYTHONPATH="$work/$n${PYTHONPATH:+:$PYTHONPATH}" \
          python3 -c "import mamba; print(mamba.__file__)")
    [[ $got == "$work/$n/"* ]] || { echo "$n: mamba imports from $got" >&2; exit 1; }
done
for r in $(seq "$rounds"); do
    for t in "$a" "$b"; do
        n=$(basename "$t")
        json=()
        [ -z "${AB_JSON:-}" ] || json=(--json "$AB_JSON/$n-$r.json")
        (cd "$work" && PYTHONPATH="$work/$n${PYTHONPATH:+:$PYTHONPATH}" \
            python3 "$t/bench/gpu.py" "${opts[@]}" "${json[@]}" 2>&1 | grep -v -i warn |
            sed "s/^/$n /")
    done
done
