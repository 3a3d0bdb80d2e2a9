package main

import (
	"fmt"
	"io"
	"log/slog"
)

// telemetryFlags are the run settings for logs and telemetry names.
type telemetryFlags struct {
	logFormat, accessLog *string
}

func addTelemetrySettings(s *settings) telemetryFlags {
	return telemetryFlags{
		logFormat: s.add("log-format", "LOG_FORMAT", "text", "text or json (one JSON object a line, access logs included)"),
		accessLog: s.add("access-log", "ACCESS_LOG", "true", "log every connection, as ztunnel does: opened at debug, complete at info (refused ones rate-limited)"),
	}
}

// telemetrySettings are telemetryFlags parsed.
type telemetrySettings struct {
	jsonLogs  bool
	accessLog bool
}

func (f telemetryFlags) parse(s *settings) (telemetrySettings, error) {
	var t telemetrySettings
	switch *f.logFormat {
	case "text":
	case "json":
		t.jsonLogs = true
	default:
		return t, fmt.Errorf("%s: %q is not text or json", s.name(f.logFormat), *f.logFormat)
	}
	switch *f.accessLog {
	case "true":
		t.accessLog = true
	case "false":
	default:
		return t, fmt.Errorf("%s: %q is not true or false", s.name(f.accessLog), *f.accessLog)
	}
	return t, nil
}

// logHandler writes the agent's logs in the configured format.
func (t telemetrySettings) logHandler(w io.Writer, opts *slog.HandlerOptions) slog.Handler {
	if t.jsonLogs {
		return slog.NewJSONHandler(w, opts)
	}
	return slog.NewTextHandler(w, opts)
}
