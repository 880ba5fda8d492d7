"""Split one selection launch's warp-state samples (`select-ncu.sh`'s SASS csv) into the chunk phase (instructions
every program runs) and the merge tail (instructions only each pair's last program runs), and the tail into its
runs of equal execution count (a loop body is one run). A phase's time share is its samples per program: a program
is one SM's only block here (8 warps, 2 a scheduler), so an SM's samples grow with its busy time.
    python docs/lease/select_phases.py SASS_CSV PROGRAMS PAIRS DURATION_US [WARPS_PER_PROGRAM (8)]"""
import csv
import sys


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def main(path: str, programs: int, pairs: int, duration_us: float, warps: int = 8) -> None:
    rows = list(csv.reader(open(path)))
    header, data = rows[1], rows[2:]
    samples_col, executed_col, source_col = (header.index(name) for name in
                                             ("Warp Stall Sampling (All Samples)", "Instructions Executed", "Source"))
    samples = [number(r[samples_col]) for r in data]
    executed = [int(number(r[executed_col])) for r in data]
    boundary = max(k for k, e in enumerate(executed) if e >= programs * warps)  # the other programs' exit
    chunk, tail = sum(samples[: boundary + 1]), sum(samples[boundary + 1:])
    per_chunk, per_tail = chunk / programs, tail / pairs
    unit = duration_us / (per_chunk + per_tail)
    print(f"{path}: {len(data)} SASS, {sum(samples):.0f} samples; chunk phase {per_chunk * unit:.1f} µs, "
          f"merge tail {per_tail * unit:.1f} µs (of {duration_us} µs)")
    start = boundary + 1
    for k in range(boundary + 1, len(data) + 1):
        if k == len(data) or executed[k] != executed[start]:
            run = sum(samples[start:k])
            if run >= 0.05 * tail:
                print(f"  tail SASS {start}-{k - 1}: executed {executed[start]}, {run:.0f} samples "
                      f"({run / pairs * unit:.1f} µs): {data[start][source_col].strip()[:60]}")
            start = k


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), *map(int, sys.argv[5:6]))
