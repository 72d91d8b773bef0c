"""`macaron ask "..."`: one question, the answer streamed to stdout."""

from __future__ import annotations

import argparse
import json
import sys

from macaron_local.cli.common import add_model_option, load_settings, print_json
from macaron_local.engine import GenerationParams
from macaron_local.errors import InvalidInputError
from macaron_local.session import Session
from macaron_local.tools.agent import Agent, ToolStep
from macaron_local.tools.approval import ApprovalRequest, Approvals, fixed
from macaron_local.tools.toolbox import Toolbox


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("ask", help="ask one question and stream the answer")
    parser.add_argument("prompt", nargs="*", help="the question (read from stdin when omitted or '-')")
    parser.add_argument("--expert", "-e", help="force an expert: L0 Chat, L1 Agent, L2 Coding, L3 UI")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    parser.add_argument("--system", help="system prompt for this question")
    parser.add_argument("--max-tokens", type=int, help="longest reply in tokens")
    parser.add_argument("--temperature", type=float, help="0 for greedy (the default)")
    parser.add_argument(
        "--vote",
        type=int,
        metavar="K",
        help="swarm: one greedy answer from each of K adapter variants, majority-voted (shows the split)",
    )
    tools = parser.add_mutually_exclusive_group()
    tools.add_argument("--yes-tools", action="store_true", help="offer the tools and approve every call")
    tools.add_argument(
        "--no-tools", action="store_true", help="offer the tools and deny every call that needs approval"
    )
    parser.add_argument(
        "--tool-choice",
        metavar="CHOICE",
        help="auto, required, none, or one tool's name (default: [tools] tool_choice; implies tools are offered)",
    )
    add_model_option(parser)
    parser.set_defaults(func=run)


def read_prompt(words: list[str]) -> str:
    if words and words != ["-"]:
        return " ".join(words)
    if sys.stdin is None or sys.stdin.isatty():
        raise InvalidInputError('give a question: macaron ask "What is the capital of France?"')
    try:
        text = sys.stdin.read()
    except UnicodeDecodeError:
        raise InvalidInputError("standard input is not valid UTF-8 text") from None
    if not text.strip():
        raise InvalidInputError("the question is empty")
    return text


def run(args: argparse.Namespace) -> int:
    prompt = read_prompt(args.prompt)
    settings = load_settings()
    with Session(settings, model=args.model) as session:
        if args.system is not None:
            session.system_prompt = args.system
        params = session.default_params()
        if args.max_tokens:
            params.max_tokens = args.max_tokens
        if args.temperature is not None:
            params.temperature = args.temperature
        if args.vote is not None:
            return run_vote(session, prompt, args, params)
        with Toolbox(settings) as toolbox:
            if toolbox.enabled or args.yes_tools or args.no_tools or args.tool_choice is not None:
                return run_agent(session, toolbox, prompt, args, params)
        reply = session.send(prompt, expert=args.expert, params=params)
        if args.json:
            reply.wait()
            done = reply.completion
            print_json(
                {
                    "text": reply.content,
                    "model": session.manifest.name,
                    "expert": reply.route.slot,
                    "expert_name": reply.route.expert_name,
                    "route": {"label": reply.route.slot, "method": reply.route.method, "raw": reply.route.raw},
                    "route_method": reply.route.method,
                    "route_reason": reply.route.reason,
                    "route_ms": None if reply.route.ms is None else round(reply.route.ms, 2),
                    "thinking": reply.thinking,
                    "summary": reply.summary,
                    "adapters": list(reply.adapters),
                    "prompt_tokens": done.prompt_tokens,
                    "completion_tokens": len(done.tokens),
                    "finish_reason": done.finish_reason,
                    "ttft_ms": round(done.ttft_ms, 2),
                    "total_ms": round(done.total_ms, 2),
                }
            )
        else:
            for chunk in reply:
                sys.stdout.write(chunk)
                sys.stdout.flush()
            sys.stdout.write("\n")
    return 0


def terminal_asker(request: ApprovalRequest) -> str | tuple[str, dict]:
    """Ask on the terminal (stderr for the question, the keyboard for the answer)."""
    sys.stderr.write(f"\n{request.title}\n{request.preview}\n[y]es / [n]o / [a]lways for this tool here / [e]dit: ")
    sys.stderr.flush()
    answer = sys.stdin.readline().strip().lower()
    if answer in ("e", "edit"):
        sys.stderr.write("the arguments as one line of JSON: ")
        sys.stderr.flush()
        try:
            arguments = json.loads(sys.stdin.readline())
        except ValueError:
            arguments = None
        if isinstance(arguments, dict):
            return "edit", arguments
        sys.stderr.write("not a JSON object: denied\n")
        return "deny"
    return {"y": "approve", "yes": "approve", "a": "always", "always": "always"}.get(answer, "deny")


def asker_for(args: argparse.Namespace):
    """--yes-tools / --no-tools, else the terminal when there is one, else nobody (denied)."""
    if args.yes_tools:
        return fixed("approve")
    if args.no_tools:
        return fixed("deny")
    return terminal_asker if sys.stdin is not None and sys.stdin.isatty() and sys.stderr.isatty() else None


def step_reporter(args: argparse.Namespace):
    """One stderr line per finished call (none with --json: the JSON holds the trajectory)."""

    def show(step: ToolStep) -> None:
        if not args.json:
            first = (step.result.splitlines() or [""])[0]
            sys.stderr.write(f"tool {step.name}: {step.approval}, {step.status}: {first[:200]}\n")

    return show


def run_agent(session: Session, toolbox: Toolbox, prompt: str, args: argparse.Namespace, params) -> int:
    """Answer with the tools offered: each call is shown on stderr as it ends, the final answer
    on stdout (or everything as JSON, the trajectory under `tool_calls`)."""
    agent = Agent(session, toolbox.tools, Approvals(asker_for(args)), toolbox.config, on_step=step_reporter(args))
    choice = args.tool_choice or toolbox.config.tool_choice
    turn = agent.run(prompt, expert=args.expert, params=params, tool_choice=choice)
    reply = turn.reply
    if args.json:
        print_json(
            {
                "text": reply.content,
                "model": session.manifest.name,
                "expert": reply.route.slot,
                "route": {"label": reply.route.slot, "method": reply.route.method, "raw": reply.route.raw},
                "tool_calls": [step.record() | {"result": step.result} for step in turn.steps],
                "stopped_at_step_limit": turn.stopped_at_limit,
                "finish_reason": reply.completion.finish_reason,
            }
        )
    else:
        sys.stdout.write(reply.content + "\n")
    return 0


def run_vote(session: Session, prompt: str, args: argparse.Namespace, params: GenerationParams) -> int:
    """`--vote K`: the winning variant's reply, then the split (or all of it as JSON)."""
    if args.expert:
        raise InvalidInputError("--vote asks every variant; it cannot be combined with --expert")
    if params.temperature > 0:
        raise InvalidInputError("--vote answers greedily; drop --temperature")
    outcome = session.vote(prompt, args.vote, params=params)
    win = outcome.winning
    if args.json:
        print_json(
            {
                "text": win.text,
                "answer": outcome.result.winner,
                "votes": outcome.result.split,
                "k": outcome.result.k,
                "variants": [{"label": a.variant.label, "answer": a.answer, "text": a.text} for a in outcome.answers],
                "winner_variant": win.variant.label,
                "model": session.manifest.name,
                "total_ms": round(outcome.wall_ms, 2),
            }
        )
    else:
        sys.stdout.write(f"{win.text}\n{outcome.result.summary()}\n")
    return 0
