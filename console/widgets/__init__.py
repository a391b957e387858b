"""One widget per file; each draws one frozen view from `console.state`."""
