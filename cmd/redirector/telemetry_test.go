package main

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
)

func TestTelemetrySettings(t *testing.T) {
	base := []string{"--node-name", "n1", "--source", "file:/tmp", "--ca-dir", "/x"}
	for _, tc := range []struct {
		args      []string
		want      string // error substring; empty: accepted
		json, log bool
	}{
		{args: base, log: true},
		{args: append(base, "--log-format", "json", "--access-log", "false"), json: true},
		{args: append(base, "--log-format", "xml"), want: `--log-format (LOG_FORMAT): "xml" is not text or json`},
		{args: append(base, "--access-log", "yes"), want: `--access-log (ACCESS_LOG): "yes" is not true or false`},
	} {
		c, err := parseRunFlags(tc.args)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("parseRunFlags(%v): %v", tc.args, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("parseRunFlags(%v) = %v, want an error containing %q", tc.args, err, tc.want)
		case tc.want == "" && (c.telemetry.jsonLogs != tc.json || c.telemetry.accessLog != tc.log):
			t.Errorf("parseRunFlags(%v): %+v", tc.args, c.telemetry)
		}
	}
	var buf bytes.Buffer
	slog.New(telemetrySettings{jsonLogs: true}.logHandler(&buf, nil)).Info("connection complete", "src.addr", "10.0.0.1:1")
	if !strings.HasPrefix(buf.String(), "{") || !strings.Contains(buf.String(), `"src.addr":"10.0.0.1:1"`) {
		t.Errorf("json log line %q", buf.String())
	}
}
