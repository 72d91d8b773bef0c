"""`macaron logs list|show|search|export|import`: browse, search and move the conversation store."""

from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path

from macaron_local.catalog import SLOTS
from macaron_local.cli.common import load_settings, print_json
from macaron_local.errors import InvalidInputError
from macaron_local.settings import write_private_atomic
from macaron_local.store import Conversation, Message, Store, open_default_store
from macaron_local.terminal import printable
from macaron_local.untrusted import open_regular

RATING_MARKS = {1: "+1", -1: "-1"}


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("logs", help="list, show, search, export or import stored conversations")
    sub = parser.add_subparsers(dest="logs_command", metavar="ACTION", required=True)

    listing = sub.add_parser("list", help="conversations, most recent first")
    listing.add_argument("--limit", "-n", type=int, default=50, help="how many (default 50)")
    listing.add_argument("--json", action="store_true", help="print a JSON list")
    listing.set_defaults(func=run_list)

    show = sub.add_parser("show", help="a conversation's current branch (--json: everything)")
    show.add_argument("id", help="conversation id (or a unique prefix of one)")
    show.add_argument("--json", action="store_true", help="the whole conversation as JSON")
    show.set_defaults(func=run_show)

    search = sub.add_parser("search", help="full-text search across every message")
    search.add_argument("query", nargs="+", help="words to find (all must appear)")
    search.add_argument("--limit", "-n", type=int, default=20)
    search.add_argument("--json", action="store_true")
    search.set_defaults(func=run_search)

    export = sub.add_parser("export", help="write conversations as JSON lines (stdout by default)")
    export.add_argument("ids", nargs="*", metavar="ID", help="conversations to export (default: all)")
    export.add_argument("--output", "-o", help="write to this file (created 0600) instead of stdout")
    export.set_defaults(func=run_export)

    load = sub.add_parser("import", help="import conversations from a `logs export` file ('-': stdin)")
    load.add_argument("file")
    load.set_defaults(func=run_import)


def _open(*, readonly: bool = True) -> Store:
    """The store; only `import` writes, so every other action opens it read-only."""
    return open_default_store(load_settings(readonly=readonly), readonly=readonly)


def run_list(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise InvalidInputError("--limit must be at least 1")
    with _open() as store:
        rows = store.list_conversations(limit=args.limit)
    if args.json:
        print_json([vars(row) for row in rows])
        return 0
    if not rows:
        print("no conversations yet")
    for row in rows:
        when = row.updated_at[:16].replace("T", " ")
        line = f"{row.id}  {when}  {row.model or '-':<10} {row.messages:>4} msgs  {row.title or '(untitled)'}"
        print(printable(line))
    return 0


def run_show(args: argparse.Namespace) -> int:
    with _open() as store:
        conversation = store.get_conversation(store.resolve_conversation_id(args.id))
    if args.json:
        print_json(conversation.to_dict())
    else:
        sys.stdout.write(printable(render_branch(conversation), keep_newlines=True))
    return 0


def render_branch(conversation: Conversation) -> str:
    """The current branch as readable text: a header per message with the expert that answered,
    the user's feedback markers and which branch this is when there are alternatives."""
    by_id = {m.id: m for m in conversation.messages}
    branch: list[Message] = []
    node = by_id.get(conversation.current_leaf_id or "")
    while node is not None:
        branch.append(node)
        node = by_id.get(node.parent_id or "")
    branch.reverse()
    turns = {t.message_id: t for t in conversation.turns}
    feedback: dict[str, list] = {}
    for item in conversation.feedback:
        feedback.setdefault(item.message_id, []).append(item)
    siblings: dict[str | None, list[str]] = {}
    for m in conversation.messages:
        siblings.setdefault(m.parent_id, []).append(m.id)

    out = io.StringIO()
    out.write(f"{conversation.title or '(untitled)'}\n")
    out.write(
        f"id {conversation.id}  model {conversation.model or '-'}  updated {conversation.updated_at}  "
        f"{len(conversation.messages)} messages\n"
    )
    if conversation.system_prompt:
        out.write(f"system: {conversation.system_prompt}\n")
    for message in branch:
        tags = []
        turn = turns.get(message.id)
        if turn is not None and turn.expert:
            expert = f"{turn.expert} {SLOTS[turn.expert]}" if turn.expert in SLOTS else turn.expert
            tags.append(f"[{expert}{f' | {turn.route_method}' if turn.route_method else ''}]")
        notes = []
        for item in feedback.get(message.id, []):
            if item.kind == "rating":
                tags.append(f"[{RATING_MARKS.get(item.value, item.value)}]")
                if item.text:
                    notes.append(f"  comment: {item.text}")
            elif item.kind == "correction":
                tags.append("[corrected]")
                notes.append(f"  corrected to: {item.text}")
            else:
                tags.append("[regenerated]")
        alternatives = siblings.get(message.parent_id, [])
        if len(alternatives) > 1:
            tags.append(f"(branch {alternatives.index(message.id) + 1} of {len(alternatives)})")
        out.write(f"\n### {message.role} {' '.join(tags)}".rstrip() + "\n")
        out.write(message.content.rstrip("\n") + "\n")
        for note in notes:
            out.write(note + "\n")
        if turn is not None and turn.summary:  # the hidden summary hop's text for the task
            out.write(f"  summary: {turn.summary}\n")
        for call in (turn.tool_calls or []) if turn is not None else []:  # the trajectory's steps
            out.write(f"  tool call: {call['name']} ({call['approval']}, {call['status']}, {call['ms']:.0f} ms)\n")
    return out.getvalue()


def run_search(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise InvalidInputError("--limit must be at least 1")
    with _open() as store:
        hits = store.search(" ".join(args.query), limit=args.limit)
    if args.json:
        print_json([vars(hit) for hit in hits])
        return 0
    if not hits:
        print("no matches")
    for hit in hits:
        snippet = " ".join(hit.snippet.split())
        print(printable(f"{hit.conversation_id}  {hit.role:<9} {hit.title or '(untitled)'}"))
        print(f"    {printable(snippet)}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    buffer = io.StringIO(newline="\n")
    with _open() as store:
        ids = [store.resolve_conversation_id(i) for i in args.ids] or None
        count = store.export_jsonl(buffer, ids)
    data = buffer.getvalue().encode("utf-8")
    if args.output is None:
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return 0
    target = Path(args.output)
    try:
        write_private_atomic(target, data)
    except OSError as exc:
        raise InvalidInputError(f"cannot write {target}: {exc.strerror or exc}") from None
    print(f"exported {count} conversation{'s' if count != 1 else ''} to {target}", file=sys.stderr)
    return 0


def run_import(args: argparse.Namespace) -> int:
    # A regular file only: a FIFO would block, a directory or dangling link would be a traceback.
    handle = sys.stdin.buffer if args.file == "-" else os.fdopen(open_regular(args.file, "cannot read"), "rb")
    try:
        with _open(readonly=False) as store:
            result = store.import_jsonl(handle)
    finally:
        if handle is not sys.stdin.buffer:
            handle.close()
    count = len(result.imported)
    print(f"imported {count} conversation{'s' if count != 1 else ''}")
    if result.skipped:
        print(f"skipped {len(result.skipped)} already here: {', '.join(result.skipped)}")
    if result.renumbered_feedback:
        print(f"gave {result.renumbered_feedback} feedback entries new ids (their ids were taken here)")
    return 0
