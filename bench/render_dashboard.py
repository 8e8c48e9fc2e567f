"""Draw the Grafana dashboard's panels from a real Prometheus, for the README.

Grafana is not packaged here, so this runs kvwarm and Prometheus, drives a few
agents (chat, Messages and Responses, multi-turn, tool-output rounds) for a
while, then evaluates every panel query of deploy/grafana/kvwarm-dashboard.json
over the run with Prometheus's query_range API and lays the panels out on the
dashboard's own grid with matplotlib (pip install matplotlib).

    python bench/render_dashboard.py [--agents 3] [--turns 4] [--out deploy/grafana/dashboard.png]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import openai  # noqa: E402
from _common import BIN, ROOT, server_env, start, stop  # noqa: E402
from agent_traffic import system_prompt, tool_output  # noqa: E402

PORT, PROM_PORT = 8393, 9391
DASHBOARD = ROOT / "deploy" / "grafana" / "kvwarm-dashboard.json"


def agent(base: str, name: str, turns: int, seed: int) -> None:
    client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=900)
    rng = random.Random(seed)
    messages = [
        {"role": "system", "content": system_prompt(name)},
        {"role": "user", "content": "Fix the failing test."},
    ]
    for _ in range(turns):
        stream = client.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"session_id": name},
        )
        reply = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": tool_output(rng, 16)},
        ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "deploy" / "grafana" / "dashboard.png"))
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    work = Path(tempfile.mkdtemp(prefix="kvwarm-dash-"))
    (work / "prometheus.yml").write_text(
        "global: {scrape_interval: 2s}\nscrape_configs:\n"
        f"  - job_name: kvwarm\n    static_configs: [{{targets: ['127.0.0.1:{PORT}']}}]\n"
    )
    server = start(
        [str(BIN / "kvwarm"), "serve", "--port", str(PORT), "--batch", "4"],
        PORT,
        work / "kvwarm.log",
        server_env(False),
    )
    prom = subprocess.Popen(
        [
            shutil.which("prometheus"),
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{PROM_PORT}",
            "--log.level=warn",
        ],
        stdout=(work / "prom.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    prom_url = f"http://127.0.0.1:{PROM_PORT}"
    try:
        t0 = time.time()
        threads = [
            threading.Thread(
                target=agent, args=(f"http://127.0.0.1:{PORT}", f"agent-{i}", args.turns, i)
            )
            for i in range(args.agents)
        ]
        for i, t in enumerate(threads):
            t.start()
            time.sleep(5 * i)
        for t in threads:
            t.join()
        httpx.post(
            f"http://127.0.0.1:{PORT}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
        )
        time.sleep(8)
        t1 = time.time()
        dash = json.loads(DASHBOARD.read_text())
        fig = plt.figure(figsize=(24, 30), dpi=60)
        fig.patch.set_facecolor("#111217")
        rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dash["panels"])
        for panel in dash["panels"]:
            g = panel["gridPos"]
            ax = fig.add_axes(
                [
                    g["x"] / 24 + 0.01,
                    1 - (g["y"] + g["h"]) / rows + 0.015,
                    g["w"] / 24 - 0.02,
                    g["h"] / rows - 0.04,
                ]
            )
            ax.set_facecolor("#181b1f")
            ax.set_title(panel["title"], color="#d8d9da", fontsize=14, loc="left")
            ax.tick_params(colors="#8e8e8e", labelsize=9)
            for target in panel["targets"]:
                expr = target["expr"].replace("$model", ".*").replace("$__rate_interval", "30s")
                r = httpx.get(
                    prom_url + "/api/v1/query_range",
                    params={"query": expr, "start": t0, "end": t1, "step": 2},
                ).json()
                for series in r["data"]["result"]:
                    xs = [float(t) - t0 for t, _ in series["values"]]
                    ys = [float(v) for _, v in series["values"]]
                    # Grafana's {{label}} placeholders, every one the dashboard uses
                    label = re.sub(
                        r"\{\{(\w+)\}\}",
                        lambda m, labels=series["metric"]: labels.get(m.group(1), ""),
                        target["legendFormat"],
                    )
                    if panel["type"] == "stat":
                        ax.text(
                            0.5,
                            0.45,
                            f"{ys[-1]:.1%}",
                            color="#73bf69",
                            fontsize=40,
                            ha="center",
                            va="center",
                            transform=ax.transAxes,
                        )
                        ax.set_xticks([])
                        ax.set_yticks([])
                    else:
                        ax.plot(xs, ys, label=label, linewidth=1.6)
            if panel["type"] != "stat" and ax.lines:
                ax.legend(fontsize=9, facecolor="#181b1f", labelcolor="#d8d9da", loc="upper left")
        fig.savefig(args.out, facecolor=fig.get_facecolor())
        print(f"wrote {args.out} ({t1 - t0:.0f} s of traffic)")
    finally:
        prom.terminate()
        stop(server)


if __name__ == "__main__":
    main()
