"""Long runs that stay healthy, each a callback in its own file (docs/health.md): loss spikes
(`callbacks.spike`), stragglers (`callbacks.straggler`), silent data corruption
(`callbacks.checksum`), and the goodput account every run keeps."""
