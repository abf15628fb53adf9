"""Release bundles: a folder and a deterministic ``.tar.gz`` an app team ships, every file with its sha256."""
