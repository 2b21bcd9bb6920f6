"""Real coding-agent traces for the memory-fidelity benchmark, frozen under ``benchmarks/data/traces``.

Each trace is an agent working in a small project (``benchmarks/data/projects``, or the coding agent's
sample project): every tool output comes from really running the tool in a sandboxed copy of the project
(file reads, greps, test runs, scripts that print logs), and between tool calls the agent writes a short
note of its reasoning. Each trace carries facts (values, names, versions, paths) that its tool outputs
mention exactly once, early, and that are asked only at the end.

``python -m benchmarks.agent_traces`` records the traces anew and checks every fact, and records the tool
outputs of the coding agent's scripted session (``--set held-out``: only the held-out traces); the benchmarks
only read the frozen files (``load_traces``, ``kvmemory.agents.coding_agent.scripted_session.recorded_tools``), so
results never depend on what is installed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvmemory.agents.coding_agent.sample_project import create_sample_project
from kvmemory.agents.coding_agent.scripted_session import record_tool_outputs
from kvmemory.agents.coding_agent.workspace import SandboxError, Workspace

DATA = Path(__file__).parent / "data"
PROJECTS, TRACES = DATA / "projects", DATA / "traces"
SYSTEM_PROMPT = (
    "You are a careful coding agent working in a Python repository. Use the tools to inspect files, run "
    "commands and tests, fix bugs with minimal patches, and remember what you read: settings, names, "
    "versions, identifiers and errors."
)
FACTS_BEFORE = 0.75  # every fact is mentioned within the first 75% of the trace's characters


@dataclass(frozen=True)
class TraceSpec:
    name: str
    project: str  # a folder under benchmarks/data/projects, or "sample" for the coding agent's sample project
    task: str
    steps: list[tuple[str, dict, str]]  # (tool, arguments, the agent's note after reading the output)
    facts: list[tuple[str, str]]  # (question, answer): the answer occurs exactly once in the trace


SPECS = [
    TraceSpec(
        "billing",
        "billing",
        "Task: a customer reports that the VAT on a small invoice is one cent too low. Find the cause in the "
        "billing project, fix it and make every test pass. Keep track of the settings and log details you see.",
        [
            ("list_files", {}, "A small package with config, invoice and ledger modules, tests and a replay tool."),
            ("read_file", {"path": "README.md"}, "Noted the maintainer and where escalations go."),
            ("read_file", {"path": "billing/config.py"}, "Settings: VAT rate, gateway, ledger export and fees."),
            ("run_command", {"command": "pytest -q"}, "One test fails: the VAT rounding test."),
            (
                "run_command",
                {"command": "python tools/replay.py"},
                "Replayed a day of exports; one warning, one error.",
            ),
            ("read_file", {"path": "billing/invoice.py"}, "vat() uses round(), which rounds half to even."),
            ("read_file", {"path": "tests/test_invoice.py"}, "The test expects half-up rounding of the VAT."),
            (
                "run_command",
                {"command": "pytest -v --tb=long tests/test_invoice.py"},
                "The long traceback confirms the VAT comes out a cent low on a half-cent amount.",
            ),
            ("grep", {"pattern": "round"}, "total() already uses quantize with ROUND_HALF_UP; vat() should too."),
            (
                "read_file",
                {"path": "billing/ledger.py"},
                "The ledger export calls vat() directly, so it has the bug too.",
            ),
            (
                "patch_file",
                {
                    "path": "billing/invoice.py",
                    "old": "return round(self.net() * VAT_RATE, 2)  # BUG: banker's rounding; invoices round half up",
                    "new": "return (self.net() * VAT_RATE).quantize(CENT, rounding=ROUND_HALF_UP)",
                },
                "Patched vat() to quantize half up, like total().",
            ),
            ("run_command", {"command": "pytest -v"}, "All tests pass now."),
            ("read_file", {"path": "tests/test_ledger.py"}, "The ledger test covers the export header and one row."),
            ("run_command", {"command": "pytest -q -rA"}, "Full run is green; the fix is done."),
        ],
        [
            ("Who is the maintainer of the billing project?", "Tomasz Wierzbicki"),
            ("Which channel do billing escalations go to?", "#billing-oncall"),
            ("Which ticket project is needed before editing the settings?", "FIN"),
            ("Which city's office are the invoices for?", "Lisbon"),
            ("Which port does the payment gateway URL use?", "8443"),
            ("What is the ledger bucket in the config?", "acme-ledger-eu-7"),
            ("What is the cron expression of the ledger export?", "45 1 * * *"),
            ("What is the late fee percent?", "2.75"),
            ("Which currency did the gateway answer in the currency mismatch warning?", "GBP"),
            ("What was the request id of the gateway timeout?", "req-7f3a19"),
            ("After how many seconds did the gateway time out?", "30.0"),
            ("Which attempt number timed out at the gateway?", "attempt 3"),
        ],
    ),
    TraceSpec(
        "ingest",
        "ingest",
        "Task: last night's click-stream batch was not loaded cleanly. Find out why, fix what is wrong and make the "
        "tests pass. Note the pipeline's settings and the errors you find.",
        [
            ("list_files", {}, "Pipeline package, a settings file, a run script, a data file and tests."),
            ("read_file", {"path": "README.md"}, "Noted the owner, the schedule and the table dashboards use."),
            (
                "read_file",
                {"path": "ingest/settings.ini"},
                "Settings: source bucket, batch limits, retry, warehouse, alerts.",
            ),
            ("run_command", {"command": "pytest -q"}, "The export test fails because rows are rejected."),
            (
                "run_command",
                {"command": "python scripts/run_pipeline.py data/events.csv"},
                "Two rows are rejected: one has a day-first timestamp, one a page without a leading slash.",
            ),
            ("read_file", {"path": "ingest/pipeline.py"}, "parse_row accepts only ISO timestamps and absolute pages."),
            ("read_file", {"path": "data/events.csv", "max_lines": 12}, "The head of the export looks well formed."),
            ("grep", {"pattern": "TIMESTAMP_FORMAT|strptime"}, "One fixed timestamp format is used everywhere."),
            (
                "run_command",
                {"command": "pytest -v --tb=long tests/test_pipeline.py"},
                "The failing test lists both rejects; the data is bad, not the parser.",
            ),
            ("read_file", {"path": "tests/test_pipeline.py"}, "The export test demands zero rejects."),
            (
                "patch_file",
                {
                    "path": "tests/test_pipeline.py",
                    "old": '    assert len(rejects) == 0, "\\n".join(rejects)',
                    "new": '    assert len(rejects) == 2, "\\n".join(rejects)\n    assert sum(clicks.values()) == 42',
                },
                "The rejects are genuine bad rows; the test now expects exactly those two and 42 loaded clicks.",
            ),
            ("run_command", {"command": "pytest -v"}, "All four tests pass."),
            (
                "run_command",
                {"command": "python scripts/run_pipeline.py data/events.csv"},
                "The batch stays under the reject limit and loads.",
            ),
            ("run_command", {"command": "pytest -q -rA"}, "Green; I will report the two bad rows upstream."),
        ],
        [
            ("Who owns the ingest pipeline?", "Priya Raghunathan"),
            ("At what time does the pipeline run nightly (UTC)?", "02:40"),
            ("Which bucket does the pipeline read from?", "raw-events-0419"),
            ("Which region is the source bucket in?", "eu-north-1"),
            ("What is the batch size?", "750"),
            ("How many seconds is the retry backoff?", "backoff_seconds = 13"),
            ("What is the warehouse host?", "wh-analytics-03.corp"),
            ("Which channel gets the pipeline alerts?", "#ingest-alarms"),
            ("What is the pager service id?", "PD-ING-7730"),
            ("What is the export prefix in the bucket?", "exports/clicks/"),
            ("How many retry attempts does the pipeline make?", "attempts = 5"),
            ("What is the maximum reject percentage?", "max_rejects_percent = 5"),
        ],
    ),
    TraceSpec(
        "scheduler",
        "scheduler",
        "Task: a scheduled job crashed last night. Find which run crashed and why, make the job code robust to "
        "the bad message and make the tests pass. Note versions, schedules and identifiers as you go.",
        [
            ("list_files", {}, "Jobs, a runner, a simulation script, requirements and tests."),
            ("read_file", {"path": "README.md"}, "Noted who is on call and the runbook page."),
            ("read_file", {"path": "requirements.txt"}, "Pinned dependencies noted."),
            ("read_file", {"path": "scheduler/jobs.py"}, "Four jobs with their cron expressions, queues and timeouts."),
            (
                "run_command",
                {"command": "python scripts/simulate.py"},
                "One run crashed with a KeyError inside the invoice sync handler; every other run is fine.",
            ),
            ("read_file", {"path": "scheduler/runner.py"}, "sync_invoices indexes payload['tenant_id'] unguarded."),
            ("run_command", {"command": "pytest -q"}, "One test fails: a message without a tenant must be skipped."),
            ("read_file", {"path": "tests/test_jobs.py"}, "The test expects status 'skipped' for such a message."),
            ("grep", {"pattern": "tenant"}, "Only the invoice handler reads the tenant."),
            (
                "patch_file",
                {
                    "path": "scheduler/runner.py",
                    "old": "    done = handler(payload)\n",
                    "new": '    if job_name == "invoice-sync" and "tenant_id" not in payload:\n'
                    '        return "skipped", 0, 0.0\n'
                    "    done = handler(payload)\n",
                },
                "Messages without a tenant are now skipped instead of crashing the worker.",
            ),
            ("run_command", {"command": "pytest -v --tb=long"}, "All four tests pass."),
            ("run_command", {"command": "pytest -v tests/test_jobs.py"}, "The job tests pass on their own too."),
            ("run_command", {"command": "pytest -q -rA"}, "Green; done."),
        ],
        [
            ("Who is on call for the scheduler this quarter?", "Joaquín Ferreyra"),
            ("Which wiki page is the runbook?", "OPS-312"),
            ("Which version of croniter is pinned?", "2.0.5"),
            ("Which version of requests is pinned?", "2.32.3"),
            ("Which version of sqlalchemy is pinned?", "2.0.36"),
            ("Which version of pydantic is pinned?", "2.9.2"),
            ("What is the cron expression of the nightly-compaction job?", "17 3 * * *"),
            ("What is the timeout of the invoice-sync job in seconds?", "420"),
            ("What is the timeout of the nightly-compaction job in seconds?", "5400"),
            ("What is the cron expression of the usage-rollup job?", "5 * * * *"),
            ("Which run id crashed?", "run-5521"),
            ("What is the maximum number of workers per queue?", "MAX_WORKERS_PER_QUEUE = 3"),
        ],
    ),
    TraceSpec(
        "inventory",
        "sample",
        "Task: the inventory project's restock test fails. Find the bug, fix it and make every test pass. "
        "Later I will ask you about the settings and the failing test, so note them as you go.",
        [
            ("list_files", {}, "An inventory package with settings, models, pricing, report and catalogue modules."),
            ("read_file", {"path": "README.md"}, "Noted the maintainer and where pricing and settings live."),
            ("read_file", {"path": "inventory/settings.py"}, "Warehouse settings: database, timeout, codename, stock."),
            ("read_file", {"path": "inventory/pricing.py"}, "Bulk discount tiers and the VAT rate."),
            ("run_command", {"command": "pytest -q"}, "Two ledger tests fail after a restock."),
            ("read_file", {"path": "inventory/models.py"}, "restock() assigns the amount instead of adding it."),
            (
                "run_command",
                {"command": "pytest -v --tb=long tests/test_ledger.py"},
                "The traceback shows the quantity replaced by the restock amount.",
            ),
            ("grep", {"pattern": "restock"}, "restock is called only from the ledger tests."),
            (
                "patch_file",
                {
                    "path": "inventory/models.py",
                    "old": "item.quantity = amount  # BUG: should add to the existing quantity",
                    "new": "item.quantity += amount",
                },
                "Patched restock() to add to the existing quantity.",
            ),
            ("run_command", {"command": "pytest -v"}, "All tests pass."),
            ("read_file", {"path": "inventory/catalog.py", "max_lines": 45}, "The catalogue is a long table of SKUs."),
            ("run_command", {"command": "pytest -q -rA"}, "Green; done."),
        ],
        [
            ("What is the database port in settings.py?", "5433"),
            ("What is the database host in settings.py?", "db.internal"),
            ("What is the release codename in settings.py?", "blue-heron"),
            ("Who is the maintainer named in the README?", "Ilse Marchetti"),
            ("On which day is the maintainer on call?", "Tuesdays"),
            ("What is the VAT rate in pricing.py?", "0.21"),
            ("What is API_TIMEOUT_SECONDS in settings.py?", "API_TIMEOUT_SECONDS = 17"),
            ("What is the low stock threshold in settings.py?", "LOW_STOCK_THRESHOLD = 12"),
            ("What does the settings docstring say reads these values?", "scanner firmware"),
            ("What is the bulk discount for 100 or more items?", "(100, 0.15)"),
            ("What is the currency in settings.py?", 'CURRENCY = "EUR"'),
        ],
    ),
]

# Held out: written and frozen before the compositions of ``benchmarks/seed_methods.py`` were measured and
# never tuned on. Other projects and fact kinds: paths, hosts, error messages, identifiers, and decisions the
# agent itself wrote down earlier in the session.
HELD_OUT = [
    TraceSpec(
        "notifier",
        "notifier",
        "Task: one message in last night's notification batch crashed the delivery worker. Find out why, make the "
        "worker report such messages as failed instead of crashing, and make every test pass.",
        [
            ("list_files", {}, "A notifier package with settings, templates and dispatch, an outbox replay script."),
            ("read_file", {"path": "README.md"}, "Noted the maintainer and the escalation rota."),
            ("read_file", {"path": "notifier/settings.py"}, "Relay, retries, rate limit, template directory, locale."),
            ("run_command", {"command": "pytest -q"}, "One test fails: a missing template field must not crash."),
            (
                "run_command",
                {"command": "python scripts/drain_outbox.py data/outbox.jsonl"},
                "One message crashed with a KeyError; one recipient was refused by the relay; a timeout was retried.",
            ),
            (
                "read_file",
                {"path": "notifier/dispatch.py"},
                "deliver() renders the body before its try block. Decision: keep MAX_RETRIES as it is and make "
                "render errors a permanent failure.",
            ),
            ("read_file", {"path": "notifier/templates.py"}, "render() formats the template with the given fields."),
            (
                "run_command",
                {"command": "pytest -v --tb=long tests/test_dispatch.py"},
                "The traceback ends in str.format: the invoice message has no total field.",
            ),
            ("grep", {"pattern": "render"}, "render is only called from deliver."),
            ("read_file", {"path": "tests/test_dispatch.py"}, "The new test wants status 'failed' for it."),
            (
                "patch_file",
                {
                    "path": "notifier/dispatch.py",
                    "old": '    body = render(kind, message["fields"])\n',
                    "new": '    try:\n        body = render(kind, message["fields"])\n    except KeyError as err:\n'
                    "        log(f\"{message['id']} cannot be rendered: missing field {err}\")\n"
                    '        return "failed"\n',
                },
                "A message whose template lacks a field is now logged and reported as failed.",
            ),
            ("run_command", {"command": "pytest -v"}, "All four tests pass."),
            ("run_command", {"command": "pytest -q -rA"}, "Green; done."),
        ],
        [
            ("Who maintains the notifier?", "Marisol Achterberg"),
            ("Through which rota do escalations go?", "NOTIFY-OPS"),
            ("Which project needs a change request before the settings change?", "NTF"),
            ("What is the SMTP relay host?", "relay-7.mail.internal"),
            ("Which SMTP port is configured?", "2525"),
            ("Where is the template directory?", "/srv/notifier/templates/v3"),
            ("What is the default locale?", "pt-BR"),
            ("How many seconds is the retry delay?", "RETRY_DELAY_SECONDS = 45"),
            ("What is the rate limit per minute?", "RATE_LIMIT_PER_MINUTE = 37"),
            ("What did the relay answer for the refused recipient?", "550 5.1.1 mailbox unavailable"),
            ("Which message crashed in the dry run?", "msg-5e9a03"),
            ("What did you decide to do about render errors?", "make render errors a permanent failure"),
        ],
    ),
    TraceSpec(
        "tilecache",
        "tilecache",
        "Task: warmed map tiles disappear from the cache within minutes. Find the cause, fix it and make every "
        "test pass. Keep track of the configuration and what the warm-up log says.",
        [
            ("list_files", {}, "A tilecache package with config, regions and the cache, a warm-up script, tests."),
            ("read_file", {"path": "README.md"}, "Noted the owner and the incident channel."),
            ("read_file", {"path": "tilecache/config.py"}, "Cache root, TTL, size, upstream timeout, zoom range."),
            ("run_command", {"command": "pytest -q"}, "One test fails: an entry is gone an hour after it was put."),
            (
                "run_command",
                {"command": "python scripts/warm.py"},
                "Three tiles warmed, one region timed out, and two minutes later none is cached.",
            ),
            (
                "read_file",
                {"path": "tilecache/cache.py"},
                "get() divides the TTL by 1000 as if it were milliseconds. Decision: fix the unit in cache.py rather "
                "than lowering the configured TTL.",
            ),
            ("read_file", {"path": "scripts/warm.py"}, "The warm-up reads entries back two minutes after warming."),
            (
                "run_command",
                {"command": "pytest -v --tb=long tests/test_cache.py"},
                "The traceback confirms the entry expired after 86.4 seconds.",
            ),
            ("grep", {"pattern": "TILE_TTL"}, "The TTL is read only in cache.get."),
            ("read_file", {"path": "tests/test_cache.py"}, "The tests put an entry and read it an hour later."),
            (
                "patch_file",
                {
                    "path": "tilecache/cache.py",
                    "old": "if self.clock() - stored_at > config.TILE_TTL_SECONDS / 1000:  # BUG: the TTL is already "
                    "in seconds",
                    "new": "if self.clock() - stored_at > config.TILE_TTL_SECONDS:",
                },
                "get() now compares against the TTL in seconds.",
            ),
            ("run_command", {"command": "pytest -v --tb=long"}, "All four tests pass."),
            ("run_command", {"command": "pytest -q -rA"}, "Green; done."),
        ],
        [
            ("Who owns tilecache?", "Dagrun Solheim-Okafor"),
            ("Which channel gets tile incidents?", "#tiles-incidents"),
            ("Which decision record reviewed the configuration?", "ADR-0042"),
            ("What is the cache root path?", "/var/cache/tilecache/z-order"),
            ("What is the maximum number of cache entries?", "250_000"),
            ("What is the stats prefix?", "maps.tilecache.prod"),
            ("What eviction policy is configured?", 'EVICTION = "lru"'),
            ("What is the zoom range?", "MIN_ZOOM, MAX_ZOOM = 3, 17"),
            ("Which tile was warmed for Lyon?", "z14/8412/5844"),
            ("Which upstream server timed out during the warm-up?", "tiles-ap-4.maps.internal"),
            ("What did you decide instead of lowering the configured TTL?", "fix the unit in cache.py"),
        ],
    ),
]
TRACE_SETS = {"tuning": SPECS, "held-out": HELD_OUT}


def _project(spec: TraceSpec, into: Path) -> Path:
    if spec.project == "sample":
        return create_sample_project(into)
    return Path(shutil.copytree(PROJECTS / spec.project, into, dirs_exist_ok=True))


def record(spec: TraceSpec) -> dict:
    """Run the trace's tools for real and return it as chat messages (the shape ``Session.set_messages`` takes)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": spec.task}]
    with tempfile.TemporaryDirectory() as tmp:
        workspace = Workspace(_project(spec, Path(tmp) / spec.name))
        for i, (tool, args, note) in enumerate(spec.steps):
            call = {"type": "function", "id": f"call_{i}", "function": {"name": tool, "arguments": args}}
            try:
                output = getattr(workspace, tool)(**args)
            except SandboxError as err:
                output = f"error: {err}"
            messages += [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": output, "name": tool, "tool_call_id": call["id"]},
                {"role": "assistant", "content": note},
            ]
    return {"name": spec.name, "messages": messages, "facts": [list(f) for f in spec.facts]}


def trace_text(messages: list[dict]) -> str:
    """Everything the model reads of a trace, in order (contents and tool-call arguments)."""
    parts = []
    for m in messages:
        parts.append(m["content"])
        parts += [json.dumps(c["function"]["arguments"]) for c in m.get("tool_calls", [])]
    return "\n".join(parts)


def fact_problems(trace: dict) -> list[str]:
    """Why a fact would not measure memory: mentioned more or less than once, or only late in the trace."""
    text = trace_text(trace["messages"])
    problems = []
    for question, answer in trace["facts"]:
        count = text.count(answer)
        if count != 1:
            problems.append(f"{trace['name']}: {answer!r} occurs {count} times")
        elif text.index(answer) > FACTS_BEFORE * len(text):
            problems.append(f"{trace['name']}: {answer!r} is first read after {FACTS_BEFORE:.0%} of the trace")
    return problems


def load_traces(names: list[str] | None = None, trace_set: str = "tuning") -> list[dict]:
    """The frozen traces of a set (``TRACE_SETS``: all, or those named), in its order."""
    chosen = [s.name for s in TRACE_SETS[trace_set] if names is None or s.name in names]
    return [json.loads((TRACES / f"{name}.json").read_text()) for name in chosen]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--set", choices=TRACE_SETS, default="tuning", help="which traces to record")
    args = parser.parse_args()
    TRACES.mkdir(parents=True, exist_ok=True)
    problems = []
    for spec in TRACE_SETS[args.set]:
        trace = record(spec)
        problems += fact_problems(trace)
        (TRACES / f"{spec.name}.json").write_text(json.dumps(trace, indent=1, ensure_ascii=False))
        print(f"{spec.name}: {len(trace['messages'])} messages, {len(trace_text(trace['messages'])):,} characters")
    print("\n".join(problems) or "every fact is mentioned exactly once, early")
    if args.set == "tuning":
        print(f"scripted session: {len(record_tool_outputs())} tool outputs")


if __name__ == "__main__":
    main()
