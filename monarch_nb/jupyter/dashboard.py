"""The training dashboard: progress, loss, accuracy and gradient-norm curves with fault and recovery markers,
an event timeline, the recovery figures (detection, resume, rejoin) and a button that stops the run.

One anywidget model, drawn as inline SVG by an ES module shipped as a string. It is fed plain
dicts, so it works with any source: :meth:`TrainingDashboard.attach` follows a
``monarch_nb.train`` run (``run.subscribe`` gives metric dicts and recovery records) and the
controller's supervision events; tests feed it synthetic dicts through :meth:`add_metric`,
:meth:`add_record` and :meth:`add_event`. Updates reach the browser from a background thread at
most ``max_hz`` times a second, inside ``hold_sync()``.

Recognised inputs:
    metric: ``{"step", "loss", "batch_accuracy", "time_s", "quorum", "live_ranks", "grad_norm"}`` (a dict
        with "loss"; ``grad_norm`` is optional: the training run's largest local gradient norm).
    recovery record: ``monarch_nb.train``'s ``{"type": "recovery", "event": "failed" | "detected"
        | "resumed" | "rejoined", "kind", "rank", "step", "latency_s"}`` (latency from the fault's
        injection), or any dict with a ``kind`` and some of ``detection_ms``, ``resume_ms``,
        ``rejoin_ms`` (``*_s`` variants too).
    supervision event: :class:`~monarch_nb.supervision.events.Event` (faults and failures become
        red markers, restarts green ones).
"""

from __future__ import annotations

import html
import logging
import statistics
import threading
import time
import weakref
from typing import Any

import anywidget
import traitlets

from .fallback import StaticFallback
from .refresh import push_changes, refresh_loop

__all__ = ["TrainingDashboard", "FIGURES"]

log = logging.getLogger(__name__)

#: the recovery figures shown, and the record keys each is read from (ms or s)
FIGURES = {
    "detection": ("detection_ms", "detect_ms", "detection_s", "detect_s"),
    "resume": ("resume_ms", "resumed_ms", "resume_s", "recovery_ms", "recovery_s"),
    "rejoin": ("rejoin_ms", "heal_ms", "rejoin_s", "heal_s"),
}
_MAX_POINTS = 600
_FAULT_EVENTS = {"fault_injected", "proc_exited", "proc_hung", "proc_fenced"}
_RECOVERY_EVENTS = {"proc_restarted"}

_ESM = r"""
function svgEl(tag, attrs) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}
function chart(title, points, key, markers, color, maxStep) {
  const W = 420, H = 150, L = 40, R = 10, T = 18, B = 22;
  const svg = svgEl("svg", {width: W, height: H, class: `mnb-chart mnb-chart-${key}`});
  const t = svgEl("text", {x: L, y: 12, "font-size": 11}); t.textContent = title; svg.append(t);
  const ys = points.map(p => p[key]).filter(v => v !== null && v !== undefined && isFinite(v));
  const lo = ys.length ? Math.min(...ys) : 0, hi = ys.length ? Math.max(...ys) : 1;
  const span = hi - lo || 1;
  const x = s => L + (W - L - R) * (maxStep ? s / maxStep : 0);
  const y = v => T + (H - T - B) * (1 - (v - lo) / span);
  svg.append(svgEl("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999"}));
  svg.append(svgEl("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#999"}));
  for (const [v, yy] of [[hi, T + 4], [lo, H - B]]) {
    const lab = svgEl("text", {x: 2, y: yy, "font-size": 9}); lab.textContent = Number(v).toPrecision(3); svg.append(lab);
  }
  for (const m of markers) {
    const c = m.type === "fault" ? "#c62828" : "#2e7d32";
    const line = svgEl("line", {x1: x(m.step), x2: x(m.step), y1: T, y2: H - B, stroke: c, "stroke-dasharray": "3,2",
      class: `mnb-marker mnb-marker-${m.type}`});
    const tip = svgEl("title"); tip.textContent = `${m.label} (step ${m.step})`; line.append(tip);
    svg.append(line);
  }
  const d = points.filter(p => p[key] !== null && p[key] !== undefined && isFinite(p[key]))
    .map((p, i) => `${i ? "L" : "M"}${x(p.step).toFixed(1)},${y(p[key]).toFixed(1)}`).join("");
  if (d) svg.append(svgEl("path", {d, fill: "none", stroke: color, "stroke-width": 1.5}));
  const sx = svgEl("text", {x: W - R - 60, y: H - 6, "font-size": 9}); sx.textContent = `step (of ${maxStep})`; svg.append(sx);
  return svg;
}
function render({ model, el }) {
  const root = document.createElement("div"); root.className = "mnb-dash"; el.append(root);
  // The elements stay; a redraw (up to 10 a second while training) changes their contents. A
  // button made anew at each redraw lost the clicks whose mousedown and mouseup fell on either
  // side of one (a person's click lasts ~100 ms), and the timeline lost its scroll position.
  const head = document.createElement("div"); head.className = "mnb-progress";
  const bar = document.createElement("progress");
  const text = document.createElement("span"); text.className = "mnb-progress-text";
  const stop = document.createElement("button");
  stop.className = "mnb-dash-stop"; stop.textContent = "stop training";
  stop.title = "end the run at the next step boundary: every step so far is kept, and the report shows";
  stop.onclick = () => {
    stop.disabled = true; model.send({action: "stop"});
    setTimeout(() => { stop.disabled = false; }, 5000);  // not answered (still training): may be clicked again
  };
  head.append(bar, text, " ", stop);
  const charts = document.createElement("div"); charts.className = "mnb-charts";
  const ft = document.createElement("div"); ft.className = "mnb-figures";
  const tl = document.createElement("div"); tl.className = "mnb-timeline";
  const rep = document.createElement("pre"); rep.className = "mnb-report";
  root.append(head, charts, ft, tl, rep);
  const draw = () => {
    const p = model.get("progress") || {};
    bar.max = p.total || 1; bar.value = p.step || 0;
    text.textContent = ` step ${p.step || 0}/${p.total || "?"} · ${p.status || ""}` +
      (p.loss !== undefined && p.loss !== null ? ` · loss ${Number(p.loss).toFixed(4)}` : "") +
      (p.accuracy !== undefined && p.accuracy !== null ? ` · batch accuracy ${(100 * p.accuracy).toFixed(1)}%` : "") +
      (p.grad_norm !== undefined && p.grad_norm !== null ? ` · grad norm ${Number(p.grad_norm).toPrecision(3)}` : "") +
      (p.live_ranks !== undefined && p.live_ranks !== null ? ` · live ranks ${p.live_ranks}` : "");
    stop.hidden = !p.stoppable;
    const pts = model.get("metrics") || [], markers = model.get("markers") || [];
    const maxStep = Math.max(p.total || 0, ...pts.map(q => q.step), 1);
    const drawn = [chart("loss", pts, "loss", markers, "#1565c0", maxStep), chart("batch accuracy", pts, "accuracy", markers, "#6a1b9a", maxStep)];
    if (pts.some(q => q.grad_norm !== null && q.grad_norm !== undefined))
      drawn.push(chart("grad norm", pts, "grad_norm", markers, "#ef6c00", maxStep));
    charts.replaceChildren(...drawn);
    const figs = model.get("figures") || {};
    const names = Object.keys(figs);
    ft.textContent = names.length ? "recovery: " + names.map(
      k => `${k} ${figs[k].median_ms.toFixed(0)} ms (n=${figs[k].n}, max ${figs[k].max_ms.toFixed(0)})`).join(" · ")
      : "recovery: no failure yet";
    const rows = [];
    for (const e of (model.get("timeline") || []).slice().reverse()) {
      const row = document.createElement("div"); row.className = `mnb-tl mnb-tl-${e.type}`;
      row.textContent = `${e.clock}  ${e.step !== null && e.step !== undefined ? "step " + e.step + "  " : ""}${e.label}`;
      rows.push(row);
    }
    tl.replaceChildren(...rows);
    const report = model.get("report");
    rep.textContent = report || ""; rep.hidden = !report;
  };
  for (const n of ["progress", "metrics", "markers", "figures", "timeline", "report"]) model.on(`change:${n}`, draw);
  draw();
}
export default { render };
"""

_CSS = """
.mnb-dash { font-family: var(--jp-ui-font-family, sans-serif); font-size: 12px; }
.mnb-progress progress { width: 240px; vertical-align: middle; }
.mnb-dash-stop { margin-left: 8px; font-size: 11px; }
.mnb-dash [hidden] { display: none !important; }
.mnb-charts { display: flex; flex-wrap: wrap; gap: 8px; margin: 4px 0; }
.mnb-figures { margin: 4px 0; font-weight: bold; }
.mnb-timeline { max-height: 140px; overflow: auto; font-family: var(--jp-code-font-family, monospace); }
.mnb-tl-fault { color: #c62828; }
.mnb-tl-recovered { color: #2e7d32; }
.mnb-report { max-height: 240px; overflow: auto; }
"""


class TrainingDashboard(StaticFallback, anywidget.AnyWidget):
    """Live view of a training run. ``%mesh train`` shows one; ``attach(run)`` follows a run."""

    _esm = traitlets.Unicode(_ESM).tag(sync=True)
    _css = traitlets.Unicode(_CSS).tag(sync=True)
    progress = traitlets.Dict().tag(sync=True)
    metrics: traitlets.List[Any] = traitlets.List().tag(sync=True)
    markers: traitlets.List[Any] = traitlets.List().tag(sync=True)
    timeline: traitlets.List[Any] = traitlets.List().tag(sync=True)
    figures = traitlets.Dict().tag(sync=True)
    report = traitlets.Unicode("").tag(sync=True)

    def __init__(self, total_steps: int | None = None, max_hz: float = 10.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.total_steps = total_steps
        self._min_interval_s = 1.0 / max_hz
        self._lock = threading.Lock()
        self._metrics: list[dict] = []
        self._markers: list[dict] = []
        self._timeline: list[dict] = []
        self._samples: dict[str, list[float]] = {name: [] for name in FIGURES}
        self._status = "waiting"
        self._report = ""
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._unsubscribe: list = []
        self.run: Any = None
        self.updates = 0
        self._push()
        ref = weakref.ref(self)
        self._thread = threading.Thread(
            target=refresh_loop, args=(ref, self._dirty, self._stop, "_push"), kwargs={"final": True}, name="mnb-dashboard", daemon=True
        )
        self._thread.start()
        self.on_msg(self._on_frontend_msg)

    def _on_frontend_msg(self, _widget: Any, content: dict, _buffers: list) -> threading.Thread | None:
        """The browser's "stop training" button: the run ends at its next step boundary (on a
        thread: the kernel's message loop is not held); returns that thread, or None if there is
        no run to stop."""
        run = self.run
        if content.get("action") != "stop" or run is None or run.done():
            return None
        self.set_status("stopping")
        worker = threading.Thread(target=run.stop, name="mnb-dashboard-stop", daemon=True)
        worker.start()
        return worker

    def click_stop(self) -> threading.Thread | None:
        """Do what a click on "stop training" does; returns the thread that stops the run."""
        return self._on_frontend_msg(self, {"action": "stop"}, [])

    # -- feeding ----------------------------------------------------------------------------------
    def add_metric(self, metric: dict) -> None:
        """One training step's metrics (``step``, ``loss``, ``accuracy``, ``grad_norm``, ...)."""
        point = {
            "step": int(metric.get("step", len(self._metrics))),
            "loss": _num(metric.get("loss")),
            "accuracy": _num(metric.get("batch_accuracy", metric.get("accuracy"))),  # the step's own batch
            "grad_norm": _num(metric.get("grad_norm")),
            "time_s": _num(metric.get("time_s")),
            "live_ranks": _live(metric.get("live_ranks")),
        }
        with self._lock:
            self._metrics.append(point)
            if self._status == "waiting":
                self._status = "training"
        self._dirty.set()

    def add_record(self, record: dict) -> None:
        """A recovery record from the training run: a marker, a timeline row, figures."""
        if record.get("type") == "recovery" and "event" in record:
            return self._add_train_record(record)
        kind = str(record.get("kind") or record.get("event") or record.get("type") or "recovery")
        step = record.get("step")
        if step is None:
            step = self._last_step()
        rank = record.get("rank", record.get("ranks"))
        figures = []
        for name, keys in FIGURES.items():
            for key in keys:
                value = record.get(key)
                if isinstance(value, (int, float)) and value == value:
                    ms = float(value) * (1000.0 if key.endswith("_s") else 1.0)
                    figures.append(f"{name} {ms:.0f} ms")
                    with self._lock:
                        self._samples[name].append(ms)
                    break
        failure = any(w in kind for w in ("fail", "fault", "lost", "dead", "exit", "hung", "nan"))
        marker_type = "fault" if failure and not figures else "recovered"
        label = f"{kind}" + (f" rank {rank}" if rank is not None else "") + (f": {', '.join(figures)}" if figures else "")
        detail = record.get("detail")
        if detail:
            label += f" ({detail})"
        self._add_marker(marker_type, int(step), label)

    def _add_train_record(self, record: dict) -> None:
        """``monarch_nb.train``'s records: event failed | detected | resumed | rejoined, with
        ``latency_s`` measured from the fault's injection."""
        event, rank, kind = record["event"], record.get("rank"), record.get("kind", "fault")
        step = record.get("step")
        step = self._last_step() if step is None else int(step)
        latency = record.get("latency_s")
        figure = {"detected": "detection", "resumed": "resume", "rejoined": "rejoin"}.get(event)
        if figure is not None and isinstance(latency, (int, float)):
            with self._lock:
                self._samples[figure].append(float(latency) * 1000.0)
        after = f" after {float(latency) * 1000:.0f} ms" if isinstance(latency, (int, float)) and event != "failed" else ""
        label = f"{kind} on rank {rank}: {event}{after}"
        if event == "failed":
            self._add_marker("fault", step, label)
        elif event in ("resumed", "rejoined"):
            self._add_marker("recovered", self._last_step() if event == "rejoined" else step, label)
        else:
            self._add_marker("info", step, label, chart=False)

    def add_event(self, event: Any) -> None:
        """A supervision event: faults and failures are red markers, restarts green ones."""
        if event.kind in _FAULT_EVENTS:
            kind = "fault"
        elif event.kind in _RECOVERY_EVENTS:
            kind = "recovered"
        else:
            return
        self._add_marker(kind, self._last_step(), f"{event.kind} rank {event.rank}: {event.detail}", when=event.time)

    def _add_marker(self, kind: str, step: int, label: str, when: float | None = None, chart: bool = True) -> None:
        when = time.time() if when is None else when
        with self._lock:
            if chart:
                self._markers.append({"type": kind, "step": step, "label": label})
            self._timeline.append({"type": kind, "step": step, "label": label, "time": when,
                                   "clock": time.strftime("%H:%M:%S", time.localtime(when))})
        self._dirty.set()

    def _last_step(self) -> int:
        with self._lock:
            return self._metrics[-1]["step"] if self._metrics else 0

    def set_status(self, status: str, report: str | None = None) -> None:
        with self._lock:
            self._status = status
            if report is not None:
                self._report = report
        self._dirty.set()

    # -- following a run --------------------------------------------------------------------------
    def attach(self, run: Any, controller: Any = None, mesh: str | None = None) -> "TrainingDashboard":
        """Follow ``run`` (a ``monarch_nb.train`` TrainingRun: its metrics and recovery records).

        With ``controller`` (and ``mesh``), supervision events of that proc mesh become markers
        too, for runs that do not report recoveries themselves.
        """
        self.run = run
        for metric in list(getattr(run, "metrics", []) or []):
            self.add_metric(metric)

        def on_item(item: Any) -> None:
            if isinstance(item, dict) and item.get("type") in ("phase", "eval"):
                return  # the run's phase changes and test evaluations are not drawn here
            if isinstance(item, dict) and "loss" in item:
                self.add_metric(item)
            elif isinstance(item, dict):
                self.add_record(item)
            elif hasattr(item, "to_dict"):
                self.add_record(item.to_dict())

        unsubscribe = run.subscribe(on_item)
        if callable(unsubscribe):
            self._unsubscribe.append(unsubscribe)
        if controller is not None:

            def on_event(event: Any) -> None:
                if mesh is None or event.mesh == mesh:
                    self.add_event(event)

            self._unsubscribe.append(controller.events.subscribe(on_event))
        self.set_status("training")
        threading.Thread(target=self._await_end, name="mnb-dashboard-end", daemon=True).start()
        return self

    def _await_end(self) -> None:
        run = self.run
        while not self._stop.is_set():
            try:
                if run.wait(0.5):
                    break
            except Exception:
                break
        if self._stop.is_set():
            return
        try:
            report = run.report(timeout=5)
            self.set_status("done", str(report))
        except Exception as exc:
            self.set_status(f"ended with {type(exc).__name__}: {exc}")

    # -- pushing ----------------------------------------------------------------------------------
    def _push(self) -> None:
        with self._lock:
            metrics = _downsample(self._metrics, _MAX_POINTS)
            last = self._metrics[-1] if self._metrics else {}
            total = self.total_steps or (last.get("step", 0) if last else 0)
            progress: dict[str, Any] = {"step": last.get("step", 0) + (1 if last else 0) if last else 0, "total": total,
                        "status": self._status, "loss": last.get("loss"), "accuracy": last.get("accuracy"),
                        "grad_norm": last.get("grad_norm"), "live_ranks": last.get("live_ranks"),
                        "stoppable": self.run is not None and self._status == "training"}
            if progress["total"] and progress["step"] > progress["total"]:
                progress["step"] = progress["total"]
            markers = list(self._markers[-200:])
            timeline = list(self._timeline[-50:])
            figures = {name: {"n": len(v), "median_ms": statistics.median(v), "max_ms": max(v), "last_ms": v[-1]}
                       for name, v in self._samples.items() if v}
            report = self._report
        push_changes(self, progress=progress, metrics=metrics, markers=markers, timeline=timeline, figures=figures,
                     report=report)
        self.updates += 1

    # -- the static fallback (saved notebooks, after %mesh stop) ------------------------------------
    def _summary_lines(self) -> list[str]:
        self._push()  # the state as of now, not as of the last refresh
        p = self.progress
        head = f"training: step {p.get('step', 0)}/{p.get('total') or '?'} · {p.get('status', '')}"
        if p.get("loss") is not None:
            head += f" · loss {p['loss']:.4f}"
        if p.get("live_ranks") is not None:
            head += f" · live ranks {p['live_ranks']}"
        figures = " · ".join(f"{k} {v['median_ms']:.0f} ms (n={v['n']})" for k, v in self.figures.items())
        lines = [head, "recovery: " + (figures or "no failure")]
        lines += [f"{e['clock']}  {'step ' + str(e['step']) + '  ' if e.get('step') is not None else ''}{e['label']}"
                  for e in self.timeline[-10:]]
        return lines

    def static_text(self) -> str:
        return "\n".join(self._summary_lines() + ([self.report] if self.report else []))

    def static_html(self) -> str:
        lines = self._summary_lines()
        body = "".join(f"<div>{html.escape(line)}</div>" for line in lines)
        report = f"<pre>{html.escape(self.report)}</pre>" if self.report else ""
        return (f'<div class="mnb-dash-static" style="font-size:12px">{body}{report}'
                '<div style="color:#777;font-style:italic">a snapshot of the training dashboard</div></div>')

    def close(self) -> None:
        self._stop.set()
        self._dirty.set()
        for unsubscribe in self._unsubscribe:
            try:
                unsubscribe()
            except Exception:
                pass
        super().close()


def _num(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if value == value and abs(value) != float("inf") else None


def _live(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple, set)):
        return len(value)
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _downsample(points: list[dict], limit: int) -> list[dict]:
    if len(points) <= limit:
        return list(points)
    stride = len(points) / limit
    picked = [points[int(i * stride)] for i in range(limit - 1)]
    return picked + [points[-1]]

