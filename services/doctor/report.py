"""The doctor's report: Markdown (the terminal gets the same text), PNG plots, or JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tandem.services.doctor.diagnosis import Diagnosis
from tandem.services.doctor.evidence import DECODING_ROLES, Evidence
from tandem.services.doctor.levers import Lever, ranked, recommended
from tandem.services.doctor.questions import Answer, answer_all
from tandem.services.extras import require

LATENCY_PLOT = "latency.png"
LOAD_PLOT = "batch_kv.png"


@dataclass(frozen=True)
class Report:
    url: str
    window_s: float
    answers: list[Answer]
    levers: list[Lever]  # every lever that applies, ranked

    @classmethod
    def of(cls, url: str, diagnosis: Diagnosis) -> Report:
        return cls(url, diagnosis.window_s, answer_all(diagnosis), ranked(diagnosis))

    @property
    def recommended(self) -> list[Lever]:
        return recommended(self.levers)

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "window_s": self.window_s,
                "answers": [asdict(a) for a in self.answers],
                "levers": [asdict(lever) for lever in self.levers],
                "recommended": [lever.key for lever in self.recommended]}

    def markdown(self, plots: bool = False) -> str:
        window = (f"the last {self.window_s:g} s" if self.window_s > 0
                  else "everything since the gateway started")
        lines = [f"# tandem doctor: {self.url}", "", f"Measured over {window}.", "",
                 "## Levers, most expected effect first", ""]
        if self.recommended:
            lines += ["| # | lever | change | expected saving of mean E2E |", "|---|---|---|---|"]
            lines += [f"| {i} | {lever.name} | `{lever.change}` | {100 * lever.effect:.0f}% |"
                      for i, lever in enumerate(self.recommended, 1)]
            lines += [""] + [f"{i}. **{lever.change}**: {lever.evidence}"
                             for i, lever in enumerate(self.recommended, 1)]
        else:
            lines.append("None expected to save 1% or more of the mean request's latency.")
        rest = [lever for lever in self.levers if lever not in self.recommended]
        if rest:
            lines += ["", "Checked, expected to save under 1%: "
                      + ", ".join(f"`{lever.change}`" for lever in rest) + "."]
        lines += ["", "## The six questions", ""]
        for answer in self.answers:
            lines += [f"### {answer.question}", "", f"**{answer.verdict}**", ""]
            lines += [f"- {name}: {value}" for name, value in answer.numbers.items()]
            if plots and answer.key == "latency":
                lines += ["", f"![latency breakdown]({LATENCY_PLOT})"]
            if plots and answer.key == "batch":
                lines += ["", f"![batch and KV usage]({LOAD_PLOT})"]
            lines.append("")
        return "\n".join(lines).rstrip() + "\n"


def write(out: Path, report: Report, diagnosis: Diagnosis, evidence: Evidence) -> Path:
    """``out``/report.md and its plots; returns the report's path."""
    out.mkdir(parents=True, exist_ok=True)
    _plot_latency(out / LATENCY_PLOT, diagnosis)
    _plot_load(out / LOAD_PLOT, evidence)
    path = out / "report.md"
    path.write_text(report.markdown(plots=True))
    return path


def _plot_latency(path: Path, d: Diagnosis) -> None:
    matplotlib = require("matplotlib", "tandem doctor's plots (--out)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = {"queueing": d.queue_s, "prefill": d.prefill_s, "KV transfer": d.transfer_s,
             "decode": d.decode_s}
    fig, ax = plt.subplots(figsize=(7, 2.2))
    left = 0.0
    for name, seconds in parts.items():
        ax.barh([0], [1000 * seconds], left=[left], label=f"{name} {1000 * seconds:.0f} ms")
        left += 1000 * seconds
    ax.set_yticks([])
    ax.set_xlabel("ms of a mean request")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.02), ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_load(path: Path, evidence: Evidence) -> None:
    matplotlib = require("matplotlib", "tandem doctor's plots (--out)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reads = evidence.reads or (evidence.last,)
    running = [sum(r.per_worker("tandem_num_requests_running", DECODING_ROLES).values())
               for r in reads]
    usage = [max(r.per_worker("tandem_kv_cache_usage_perc", DECODING_ROLES).values(),
                 default=0.0) for r in reads]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 2.6))
    left.hist(running, bins=[b - 0.5 for b in range(int(max(running, default=0)) + 2)],
              rwidth=0.8)
    left.set_xlabel("sequences running on decoding engines")
    left.set_ylabel("reads")
    right.hist([100 * u for u in usage], bins=10, range=(0, 100))
    right.set_xlabel("KV usage of the fullest decoding engine (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
