"""The HTTP surface: routes, error bodies, the connection layer, SSE, WebSocket, OpenAPI, auth and
browser checks."""
