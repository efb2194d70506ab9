"""An MCP server over stdio, written with the `mcp` package (`pip install 'aici-batch[tools]'`):
a calculator and a key-value lookup over a small local table, for docs/tools.md's example:

    aici-batch run examples/tools/questions.jsonl -o answers.jsonl \\
        --mcp calc="python examples/tools/calc_server.py"
"""

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

# Made-up facts, so that a right answer needs the tool.
TABLE = {"zorblax": "42", "quibble": "17", "capital of Veltria": "Ostrand"}

server = MCPServer("calc", log_level="ERROR")


@server.tool()
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


@server.tool()
def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


@server.tool()
def lookup(key: str) -> str:
    """The value stored under a key in the local table."""
    if key not in TABLE:
        raise ToolError(f"no entry {key!r}")  # told to the model, which may try again
    return TABLE[key]


if __name__ == "__main__":
    server.run()
