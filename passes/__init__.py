"""Built-in qgraph passes, written only against qgraph's public pass API."""
