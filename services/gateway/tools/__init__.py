"""Tool calling and reasoning: tools in the prompt, calls and reasoning parsed from the reply."""
