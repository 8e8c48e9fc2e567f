"""Text protocol shared by every API dialect: thinking controls, tool schemas,
tool-call markup and the streaming classifier of generated text."""
