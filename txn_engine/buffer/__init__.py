"""The transaction buffer: the per-topic kernel that holds every buffer rule once (`kernel`), its
Spark runner (`spark`), incremental runs with state in and state out (`refresh`) and the asset
checks (`checks`)."""
