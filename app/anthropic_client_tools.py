"""The Anthropic-defined tools a client runs itself (bash, the text editor,
memory), described to the model by their documented inputs: it must see them to
call them (they were dropped like server tools, which nothing here runs)."""

from __future__ import annotations

from typing import Any

from app.anthropic_schemas import ServerTool

_BASH = {
    "type": "object",
    "properties": {
        "command": {"type": "string", "description": "The bash command to run."},
        "restart": {"type": "boolean", "description": "Restart the bash session."},
    },
}
# what the text editor and memory tools share
_FILE_EDITS = {
    "file_text": {"type": "string", "description": "The file's content (create)."},
    "insert_line": {"type": "integer", "description": "Insert after this line (insert)."},
    "view_range": {
        "type": "array",
        "items": {"type": "integer"},
        "description": "[start, end] lines (view).",
    },
}
_TEXT_EDITOR = {
    "type": "object",
    "properties": {
        "command": {
            "type": "string",
            "enum": ["view", "create", "str_replace", "insert", "undo_edit"],
        },
        "path": {"type": "string", "description": "Absolute path to a file or directory."},
        "old_str": {
            "type": "string",
            "description": "Text to replace, exactly once (str_replace).",
        },
        "new_str": {"type": "string", "description": "Its replacement, or the text to insert."},
        **_FILE_EDITS,
    },
    "required": ["command", "path"],
}
_MEMORY = {
    "type": "object",
    "properties": {
        "command": {
            "type": "string",
            "enum": ["view", "create", "str_replace", "insert", "delete", "rename"],
        },
        "path": {"type": "string", "description": "A path under /memories."},
        "old_str": {"type": "string", "description": "Text to replace (str_replace)."},
        "new_str": {"type": "string", "description": "Its replacement (str_replace)."},
        "insert_text": {"type": "string", "description": "The text to insert (insert)."},
        **_FILE_EDITS,
        "old_path": {"type": "string", "description": "The path to rename (rename)."},
        "new_path": {"type": "string", "description": "Its new path (rename)."},
    },
    "required": ["command"],
}
CLIENT_TOOLS = {
    "bash_": ("bash", "Run a bash command in a persistent shell session.", _BASH),
    "text_editor_": (
        "str_replace_based_edit_tool",
        "View, create and edit files: view, create, str_replace, insert.",
        _TEXT_EDITOR,
    ),
    "memory_": (
        "memory",
        "Keep notes across conversations: view, create, edit, delete and rename files "
        "in the /memories directory.",
        _MEMORY,
    ),
}


def client_tool(tool: ServerTool) -> dict[str, Any] | None:
    for prefix, (name, description, schema) in CLIENT_TOOLS.items():
        if tool.type.startswith(prefix):
            return {"name": tool.name or name, "description": description, "parameters": schema}
    return None
