// The reprise dashboard: polls GET /admin/stats with the admin token and draws the answer as
// plain SVG. Text from the server (questions, tenant names, reasons) is only ever set with
// textContent or as an attribute value, never parsed as markup.
//
// Each chart is an <svg id="chart-..."> whose series are <g data-series="NAME"
// data-values="[JSON numbers, null where there is no value]"> with a <title> listing the
// values; a chart over time has data-times="[start_ms of each interval]";
// <body data-state> is "loading", "drawn", "no-token" or "error".
'use strict';

const POLL_MS = 10000;
const FETCH_TIMEOUT_MS = 8000;
const TOKEN_KEY = 'reprise.admin-token';
const SVG_NS = 'http://www.w3.org/2000/svg';

const TIERS = ['memory', 'redis', 'semantic', 'prefetch'];
const OUTCOMES = ['exact', 'semantic', 'prefetch', 'miss', 'bypass', 'error'];
const HIT_OUTCOMES = ['exact', 'semantic', 'prefetch'];
const SIDES = ['hit', 'miss'];
const PERCENTILES = ['p50', 'p95', 'p99'];
// Longest question shown in full in a table cell; the cell's tooltip holds all of it.
const MAX_CELL_CHARS = 300;

// Chart geometry, in viewBox units (every chart is 640 × 240).
const WIDTH = 640;
const HEIGHT = 240;
const MARGIN = { top: 14, right: 12, bottom: 28, left: 66 };

let timer = null;
// Each refresh takes a number; an answer that arrives after a newer refresh began is dropped.
let latest = 0;

document.addEventListener('DOMContentLoaded', start);

function start() {
  takeTokenFromFragment();
  byId('controls').addEventListener('submit', (event) => {
    event.preventDefault();
    const field = byId('token');
    if (field.value) {
      saveToken(field.value);
      field.value = '';
    }
    refresh();
  });
  byId('minutes').addEventListener('change', refresh);
  window.addEventListener('hashchange', () => {
    takeTokenFromFragment();
    refresh();
  });
  refresh();
}

// ---- the token -------------------------------------------------------------------------

// `#token=...` is read once, kept for this tab, and taken out of the address bar and history.
function takeTokenFromFragment() {
  const token = new URLSearchParams(location.hash.slice(1)).get('token');
  if (token) {
    saveToken(token);
    history.replaceState(null, '', location.pathname + location.search);
  }
}

// Where the token lives when sessionStorage refuses it (a private mode): this page only.
let memoryToken = '';

function saveToken(token) {
  try {
    sessionStorage.setItem(TOKEN_KEY, token);
  } catch (_) {
    memoryToken = token;
  }
}

function savedToken() {
  try {
    return sessionStorage.getItem(TOKEN_KEY) || memoryToken;
  } catch (_) {
    return memoryToken;
  }
}

// ---- polling ---------------------------------------------------------------------------

// Fetches and draws, then polls again in POLL_MS (not without a token: there is nothing to
// send). Every failure ends in the status line, none in the console.
async function refresh() {
  clearTimeout(timer);
  const mine = ++latest;
  let stats = null;
  let error = null;
  try {
    stats = await fetchStats();
  } catch (e) {
    error = e;
  }
  if (mine !== latest) return;
  try {
    if (stats) showStats(stats);
    else showError(error);
  } catch (e) {
    showError(new StatsError('format', `cannot draw the answer: ${e.message}`));
  }
  if (!error || error.kind !== 'no-token') timer = setTimeout(refresh, POLL_MS);
}

class StatsError extends Error {
  constructor(kind, message) {
    super(message);
    this.kind = kind;
  }
}

async function fetchStats() {
  const token = savedToken();
  if (!token) throw new StatsError('no-token', 'enter the admin token');
  const minutes = encodeURIComponent(byId('minutes').value);
  const abort = new AbortController();
  const timeout = setTimeout(() => abort.abort(), FETCH_TIMEOUT_MS);
  let response;
  try {
    response = await fetch(`/admin/stats?minutes=${minutes}`, {
      headers: { Authorization: `Bearer ${token}` },
      cache: 'no-store',
      signal: abort.signal,
    });
  } catch (e) {
    const why = e.name === 'AbortError' ? 'no answer in time' : e.message;
    throw new StatsError('network', `cannot reach reprise: ${why}`);
  } finally {
    clearTimeout(timeout);
  }
  if (response.status === 401) {
    throw new StatsError('refused', 'the admin token was refused (401): enter the right one');
  }
  if (!response.ok) {
    const why = await errorMessage(response);
    throw new StatsError('http', `GET /admin/stats answered ${response.status}${why}`);
  }
  try {
    return await response.json();
  } catch (_) {
    throw new StatsError('format', 'GET /admin/stats did not answer JSON');
  }
}

// The message of an OpenAI-shaped error body, if there is one.
async function errorMessage(response) {
  try {
    const body = await response.json();
    const message = body && body.error && body.error.message;
    return typeof message === 'string' ? `: ${message}` : '';
  } catch (_) {
    return '';
  }
}

function showStats(stats) {
  draw(stats);
  // A window longer than the server keeps comes back as all it keeps.
  const cut = stats.minutes < Number(byId('minutes').value)
    ? `; the window is all that is kept (${stats.minutes} min)` : '';
  setStatus('ok', `updated ${clock(stats.now_ms)}${cut}; next in ${POLL_MS / 1000} s`);
  document.body.dataset.state = 'drawn';
}

// A refused or missing token clears the page: what it showed may not be this token's to see.
// A network failure keeps the last drawing and says it is stale.
function showError(error) {
  const kind = error instanceof StatsError ? error.kind : 'bug';
  const message = error instanceof StatsError ? error.message : String(error);
  if (kind === 'refused' || kind === 'no-token') clearAll();
  const drawn = document.body.dataset.state === 'drawn' || document.body.dataset.stale;
  if (kind === 'network' && drawn) {
    document.body.dataset.stale = 'true';
    setStatus('error', `${message} (showing the last answer)`);
  } else {
    setStatus('error', message);
  }
  document.body.dataset.state = kind === 'no-token' ? 'no-token' : 'error';
}

function setStatus(kind, text) {
  const status = byId('status');
  status.dataset.kind = kind;
  status.textContent = text;
}

// ---- drawing the answer ----------------------------------------------------------------

function draw(stats) {
  delete document.body.dataset.stale;
  const series = stats.series;
  const axis = {
    times: series.map((s) => s.start_ms),
    step: stats.interval_secs * 1000,
  };
  drawScope(stats);
  drawTotals(stats.totals);

  stackedBars(byId('chart-hit-rate'), axis, TIERS.map((tier) => ({
    name: tier,
    values: series.map((s) => share(s.by_tier[tier], s.requests)),
  })), { format: percent, max: 1 });

  stackedBars(byId('chart-outcomes'), axis, OUTCOMES.map((outcome) => ({
    name: outcome,
    values: series.map((s) => s.by_outcome[outcome]),
  })), { format: count });

  lineChart(byId('chart-latency'), axis, percentileSeries(series, 'latency'), {
    format: seconds,
    refs: [{ name: 'slo', label: 'SLO', value: stats.slo.total_secs }],
  });
  lineChart(byId('chart-ttft'), axis, percentileSeries(series, 'ttft'), {
    format: seconds,
    refs: [{ name: 'slo', label: 'SLO', value: stats.slo.ttft_secs }],
  });

  drawSavings(stats.totals.saved, stats.currency);
  stackedBars(byId('chart-savings'), axis, [
    { name: 'prompt', label: 'prompt tokens', values: series.map((s) => s.saved.prompt_tokens) },
    {
      name: 'completion',
      label: 'completion tokens',
      values: series.map((s) => s.saved.completion_tokens),
    },
  ], { format: count });

  drawFigures(byId('prefetch'), stats.totals.prefetch, count);
  lineChart(byId('chart-prefetch'), axis, [
    { name: 'completed', values: series.map((s) => s.prefetch.completed) },
    { name: 'hits', label: 'used', values: series.map((s) => s.prefetch.hits) },
    { name: 'wasted', values: series.map((s) => s.prefetch.wasted) },
  ], { format: count });

  drawTenants(stats.totals.by_tenant);
  barList(byId('chart-gate'), Object.entries(stats.gate_rejections)
    .map(([reason, n]) => ({ name: reason, value: n }))
    .sort((a, b) => b.value - a.value || a.name.localeCompare(b.name)));
  fillTable(byId('table-missed'), stats.top_missed, [
    (row) => textCell(row.question, 'question'),
    (row) => numberCell(row.count, count),
    (row) => numberCell(row.best_similarity, similarity),
  ]);
  fillTable(byId('table-pairs'), stats.top_pairs, [
    (row) => textCell(row.question, 'question'),
    (row) => textCell(row.matched, 'question'),
    (row) => numberCell(row.similarity, similarity),
    (row) => numberCell(row.count, count),
    (row) => textCell(row.entry_id, 'entry'),
  ]);
}

// hit-p50 ... miss-p99 of `latency` or `ttft`, in seconds.
function percentileSeries(series, field) {
  return SIDES.flatMap((side) => PERCENTILES.map((p) => ({
    name: `${side}-${p}`,
    label: `${side} ${p}`,
    values: series.map((s) => s[field][side][p]),
  })));
}

function drawScope(stats) {
  const parts = [
    stats.tenant === null ? 'all tenants' : `tenant ${stats.tenant}`,
    `${stats.replicas} ${stats.replicas === 1 ? 'replica' : 'replicas'}`,
    `${stats.series.length} intervals of ${duration(stats.interval_secs)}`,
  ];
  byId('scope').textContent = parts.join(' · ');
}

function drawTotals(totals) {
  const hits = HIT_OUTCOMES.reduce((sum, o) => sum + totals.by_outcome[o], 0);
  setFigure(byId('totals'), 'requests', totals.requests, count);
  setFigure(byId('totals'), 'hit-rate', share(hits, totals.requests), percent);
  for (const outcome of OUTCOMES) {
    const value = share(totals.by_outcome[outcome], totals.requests);
    setFigure(byId('totals'), `${outcome}-share`, value, percent);
  }
}

function drawSavings(saved, currency) {
  const list = byId('savings');
  setFigure(list, 'prompt-tokens', saved.prompt_tokens, count);
  setFigure(list, 'completion-tokens', saved.completion_tokens, count);
  setFigure(list, 'backend-seconds', saved.backend_seconds, seconds);
  setFigure(list, 'cost', saved.cost, (cost) => money(cost, currency));
}

// Every field of `values` into the <dd data-field=...> of the same name.
function drawFigures(list, values, format) {
  for (const [field, value] of Object.entries(values)) setFigure(list, field, value, format);
}

function setFigure(list, field, value, format) {
  const dd = list.querySelector(`dd[data-field="${field}"]`);
  if (!dd) return;
  dd.dataset.value = JSON.stringify(value);
  dd.textContent = value === null ? '–' : format(value);
}

function drawTenants(byTenant) {
  const rows = Object.entries(byTenant)
    .map(([name, t]) => ({ name, requests: t.requests, hits: t.hits }))
    .sort((a, b) => b.requests - a.requests || a.name.localeCompare(b.name));
  fillTable(byId('table-tenants'), rows, [
    (row) => textCell(row.name, 'tenant'),
    (row) => numberCell(row.requests, count),
    (row) => numberCell(row.hits, count),
    (row) => numberCell(share(row.hits, row.requests), percent),
  ]);
}

function clearAll() {
  for (const svg of document.querySelectorAll('svg.chart')) {
    svg.replaceChildren();
    delete svg.dataset.times;
  }
  for (const legend of document.querySelectorAll('ul.legend')) legend.replaceChildren();
  for (const body of document.querySelectorAll('table tbody')) body.replaceChildren();
  for (const dd of document.querySelectorAll('dd[data-field]')) {
    dd.textContent = '';
    delete dd.dataset.value;
  }
  byId('scope').textContent = '';
  delete document.body.dataset.stale;
}

// ---- charts ------------------------------------------------------------------------------

// Bars per interval, one segment per series stacked from the bottom. `series`: [{name,
// label?, values}] with one value per interval (null: no bar).
function stackedBars(svg, axis, series, { format, max }) {
  svg.replaceChildren();
  const totals = axis.times.map((_, i) => series.reduce((sum, s) => sum + (s.values[i] || 0), 0));
  const y = yScale(max === undefined ? niceCeiling(Math.max(0, ...totals)) : max);
  const x = xScale(axis);
  drawAxes(svg, axis, x, y, format);
  const base = axis.times.map(() => 0);
  for (const s of series) {
    const group = seriesGroup(svg, s, format, axis);
    s.values.forEach((value, i) => {
      if (value === null || value === undefined || value <= 0) return;
      const left = x(axis.times[i]);
      const width = Math.max(1, x(axis.times[i] + axis.step) - left - 1);
      const top = y(base[i] + value);
      const rect = el('rect', {
        x: left, y: top, width, height: y(base[i]) - top, class: `bar s-${s.name}`,
      });
      rect.append(title(`${label(s)} ${clock(axis.times[i])}: ${format(value)}`));
      group.append(rect);
      base[i] += value;
    });
  }
  legend(svg, series);
}

// One line per series over the intervals' midpoints, broken where a value is null; `refs`
// are horizontal lines (targets).
function lineChart(svg, axis, series, { format, refs = [] }) {
  svg.replaceChildren();
  const values = series.flatMap((s) => s.values).concat(refs.map((r) => r.value));
  const y = yScale(niceCeiling(Math.max(0, ...values.filter(isNumber))));
  const x = xScale(axis);
  drawAxes(svg, axis, x, y, format);
  const mid = (i) => x(axis.times[i] + axis.step / 2);
  for (const s of series) {
    const group = seriesGroup(svg, s, format, axis);
    group.append(el('path', { d: linePath(s.values, mid, y), class: `line s-${s.name}` }));
    for (const i of isolatedPoints(s.values)) {
      const dot = { cx: mid(i), cy: y(s.values[i]), r: 3.5, class: `dot s-${s.name}` };
      group.append(el('circle', dot));
    }
  }
  for (const ref of refs.filter((r) => isNumber(r.value))) {
    const group = el('g', {
      'data-series': ref.name, 'data-values': JSON.stringify([ref.value]),
    });
    group.append(title(`${ref.label}: ${format(ref.value)}`));
    group.append(el('line', {
      x1: MARGIN.left, x2: WIDTH - MARGIN.right, y1: y(ref.value), y2: y(ref.value),
      class: `ref s-${ref.name}`,
    }));
    svg.append(group);
  }
  legend(svg, series.concat(refs));
}

// Horizontal bars, one per item ({name, value}), largest first as given.
function barList(svg, items) {
  svg.replaceChildren();
  if (items.length === 0) {
    svg.append(el('text', { x: WIDTH / 2, y: HEIGHT / 2, class: 'empty' }, 'none in this window'));
    return;
  }
  const labelWidth = 200;
  const rowHeight = Math.min(28, (HEIGHT - 8) / items.length);
  const max = Math.max(...items.map((item) => item.value), 1);
  const scale = (v) => (v / max) * (WIDTH - labelWidth - 60);
  items.forEach((item, i) => {
    const top = 4 + i * rowHeight;
    const group = el('g', {
      'data-series': item.name, 'data-values': JSON.stringify([item.value]),
    });
    group.append(title(`${item.name}: ${count(item.value)}`));
    const middle = top + rowHeight / 2;
    group.append(el('text', { x: labelWidth - 8, y: middle, class: 'bar-label' }, item.name));
    group.append(el('rect', {
      x: labelWidth, y: top + 2, width: Math.max(1, scale(item.value)),
      height: rowHeight - 4, class: 'bar s-gate',
    }));
    group.append(el('text', {
      x: labelWidth + scale(item.value) + 6, y: middle, class: 'bar-value',
    }, count(item.value)));
    svg.append(group);
  });
}

// The SVG path of `values` (null breaks the line).
function linePath(values, x, y) {
  let d = '';
  let drawing = false;
  values.forEach((v, i) => {
    if (!isNumber(v)) {
      drawing = false;
      return;
    }
    d += `${drawing ? 'L' : 'M'}${round(x(i))},${round(y(v))}`;
    drawing = true;
  });
  return d;
}

// Indices of values with no value on either side: a path cannot show them, a dot does.
function isolatedPoints(values) {
  return values.flatMap((v, i) => {
    const alone = isNumber(v) && !isNumber(values[i - 1]) && !isNumber(values[i + 1]);
    return alone ? [i] : [];
  });
}

// <g data-series data-values> with a <title> listing every value; appended to `svg`.
function seriesGroup(svg, s, format, axis) {
  const group = el('g', {
    'data-series': s.name,
    'data-values': JSON.stringify(s.values.map((v) => (isNumber(v) ? v : null))),
  });
  const listed = s.values.map((v, i) => {
    const shown = isNumber(v) ? format(v) : '–';
    return `${clock(axis.times[i])} ${shown}`;
  });
  group.append(title(`${label(s)}: ${listed.join(', ')}`));
  svg.append(group);
  return group;
}

function drawAxes(svg, axis, x, y, format) {
  svg.dataset.times = JSON.stringify(axis.times);
  const axes = el('g', { class: 'axes' });
  const [bottom, top] = [y.domain[0], y.domain[1]];
  for (const v of [bottom, top / 2, top]) {
    axes.append(el('line', {
      x1: MARGIN.left, x2: WIDTH - MARGIN.right, y1: y(v), y2: y(v), class: 'grid',
    }));
    axes.append(el('text', { x: MARGIN.left - 6, y: y(v), class: 'y-label' }, format(v)));
  }
  if (axis.times.length === 0) {
    const middle = { x: WIDTH / 2, y: HEIGHT / 2, class: 'empty' };
    axes.append(el('text', middle, 'no data in this window'));
  } else {
    const first = axis.times[0];
    const end = axis.times[axis.times.length - 1] + axis.step;
    for (const [t, anchor] of [[first, 'start'], [end, 'end']]) {
      axes.append(el('text', {
        x: x(t), y: HEIGHT - 8, class: `x-label ${anchor}`,
      }, clock(t)));
    }
  }
  svg.append(axes);
}

function xScale(axis) {
  const first = axis.times.length ? axis.times[0] : 0;
  const end = axis.times.length ? axis.times[axis.times.length - 1] + axis.step : 1;
  const span = Math.max(1, end - first);
  return (t) => MARGIN.left + ((t - first) / span) * (WIDTH - MARGIN.left - MARGIN.right);
}

function yScale(max) {
  const top = max > 0 ? max : 1;
  const scale = (v) => HEIGHT - MARGIN.bottom - (v / top) * (HEIGHT - MARGIN.top - MARGIN.bottom);
  scale.domain = [0, top];
  return scale;
}

// The smallest 1, 2 or 5 × 10^k at or above `v` (a round top for an axis).
function niceCeiling(v) {
  if (!(v > 0)) return 0;
  const power = 10 ** Math.floor(Math.log10(v));
  const step = [1, 2, 5, 10].find((m) => m * power >= v * (1 - 1e-9));
  return step * power;
}

function legend(svg, series) {
  const list = document.querySelector(`ul.legend[data-for="${svg.id}"]`);
  if (!list) return;
  list.replaceChildren(...series.map((s) => {
    const item = document.createElement('li');
    const swatch = document.createElement('span');
    swatch.className = `swatch s-${s.name}`;
    item.append(swatch, document.createTextNode(label(s)));
    return item;
  }));
}

// ---- tables ------------------------------------------------------------------------------

function fillTable(table, rows, cells) {
  const body = table.tBodies[0];
  if (rows.length === 0) {
    const td = document.createElement('td');
    td.colSpan = cells.length;
    td.className = 'empty';
    td.textContent = 'none in this window';
    const tr = document.createElement('tr');
    tr.append(td);
    body.replaceChildren(tr);
    return;
  }
  body.replaceChildren(...rows.map((row) => {
    const tr = document.createElement('tr');
    tr.append(...cells.map((cell) => cell(row)));
    return tr;
  }));
}

function textCell(text, kind) {
  const td = document.createElement('td');
  td.className = kind;
  const full = String(text);
  td.textContent = full.length > MAX_CELL_CHARS ? `${full.slice(0, MAX_CELL_CHARS)}…` : full;
  if (full.length > MAX_CELL_CHARS) td.title = full;
  return td;
}

function numberCell(value, format) {
  const td = document.createElement('td');
  td.className = 'num';
  td.dataset.value = JSON.stringify(value);
  td.textContent = isNumber(value) ? format(value) : '–';
  return td;
}

// ---- small helpers -----------------------------------------------------------------------

function byId(id) {
  return document.getElementById(id);
}

// An SVG element with attributes and, optionally, text.
function el(name, attrs, text) {
  const node = document.createElementNS(SVG_NS, name);
  for (const [key, value] of Object.entries(attrs)) {
    node.setAttribute(key, typeof value === 'number' ? round(value) : value);
  }
  if (text !== undefined) node.textContent = text;
  return node;
}

function title(text) {
  const node = document.createElementNS(SVG_NS, 'title');
  node.textContent = text;
  return node;
}

function label(series) {
  return series.label || series.name;
}

function isNumber(v) {
  return typeof v === 'number' && Number.isFinite(v);
}

function share(part, whole) {
  return whole > 0 ? part / whole : null;
}

function round(v) {
  return Math.round(v * 10) / 10;
}

function percent(v) {
  return `${(v * 100).toFixed(1)} %`;
}

function count(v) {
  return Math.round(v).toLocaleString();
}

function similarity(v) {
  return v.toFixed(3);
}

function seconds(v) {
  if (v === 0) return '0';
  if (v < 1) return `${Number((v * 1000).toPrecision(3))} ms`;
  return `${v.toFixed(v < 10 ? 2 : 1)} s`;
}

function duration(secs) {
  if (secs % 3600 === 0) return `${secs / 3600} h`;
  if (secs % 60 === 0) return `${secs / 60} min`;
  return `${secs} s`;
}

function money(amount, currency) {
  if (currency === null || currency === undefined) return amount.toFixed(4);
  try {
    const style = { style: 'currency', currency, maximumFractionDigits: 4 };
    return amount.toLocaleString(undefined, style);
  } catch (_) {
    // A code Intl does not know: the amount and the code as given.
    return `${amount.toFixed(4)} ${currency}`;
  }
}

function clock(ms) {
  return new Date(ms).toLocaleTimeString([], { hour: '2-digit', minute: '2-digit' });
}
