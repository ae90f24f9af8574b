"""Policy files: schema, loading with line numbers, compilation into runtime objects."""
