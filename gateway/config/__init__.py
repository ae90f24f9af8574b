"""The policy as configured: its schema, its loading with line numbers, the plug-in registry.

The bottom layer: every part of the gateway reads it, so it imports none of them.
"""
