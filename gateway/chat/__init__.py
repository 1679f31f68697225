"""Chat and tools as text: which template renders a request, rendering it with its tools and
tool calls (content kept as plain text), the shipped tool template, the grammar of a forced tool
call and the parsers that read calls back out of the model's text.

Nothing is imported here.
"""
