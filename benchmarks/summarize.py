"""Summarize a GPU run (scripts/gpu_run.sh): test counts and failures, and jnova/XLA ratios.

    python benchmarks/summarize.py OUT_DIR EXIT_CODE     # writes OUT_DIR/gpu-summary.json
"""
import json
import os
import sys
import xml.etree.ElementTree as ET


def tests(out_dir: str, name: str = "gpu-tests.xml") -> dict:
    try:
        root = ET.parse(os.path.join(out_dir, name)).getroot()
    except (OSError, ET.ParseError) as e:
        return {"error": f"no JUnit report: {e}"}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    summary = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary["failed"] = []
    for case in suite.iter("testcase"):
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            summary["failed"].append(f"{case.get('classname')}::{case.get('name')}: {problem.get('message', '')[:300]}")
    return summary


def differential(out_dir: str) -> dict:
    """Programs run, failed, kernels and XLA groups over the shards of the GPU differential test."""
    path = os.path.join(out_dir, "differential.jsonl")
    if not os.path.exists(path):
        return {}
    shards = [json.loads(line) for line in open(path) if line.strip()]
    total = {k: sum(s[k] for s in shards) for k in ("programs", "failed", "kernels", "xla_groups")}
    return {"shards": len(shards), **total, "junit": tests(out_dir, "differential.xml")}


def records(out_dir: str) -> list[dict]:
    rows = []
    for name in ("kernels.jsonl", "gpt2_step.jsonl", "gpt2_compare.jsonl"):
        path = os.path.join(out_dir, name)
        if os.path.exists(path):
            rows += [json.loads(line) for line in open(path) if line.strip()]
    return rows


def ratios(rows: list[dict]) -> dict:
    """jnova / XLA for step time and tokens/s, per (bench, case, dtype), cold runs only."""
    table = {}
    for r in rows:
        if r.get("label") or r["metric"] not in ("ms", "tok_s", "peak_gb", "compile_s"):
            continue
        table.setdefault((r["bench"], r["case"], r.get("dtype")), {}).setdefault(r["metric"], {})[r["impl"]] = r["value"]
    out = {}
    for (bench, case, dtype), metrics in table.items():
        for metric, by_impl in metrics.items():
            if "jnova" in by_impl and "xla" in by_impl and by_impl["xla"]:
                out[f"{bench}/{case}/{dtype}/{metric}"] = round(by_impl["jnova"] / by_impl["xla"], 3)
    return out


def parity(out_dir: str) -> dict:
    """examples/gpt2/parity.py's verdict: the compilers' gap, the seeds' gap, passed."""
    path = os.path.join(out_dir, "parity", "gpt2_parity.jsonl")
    if not os.path.exists(path):
        return {}
    return {r["metric"]: r["value"] for r in map(json.loads, open(path)) if r.get("impl") == "both"}


if __name__ == "__main__":
    out_dir, rc = sys.argv[1], int(sys.argv[2])
    rows = records(out_dir)
    summary = {"exit_code": rc, "tests": tests(out_dir), "differential": differential(out_dir),
               "jnova_over_xla": ratios(rows), "parity": parity(out_dir), "records": len(rows)}
    with open(os.path.join(out_dir, "gpu-summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items()}, indent=1))
