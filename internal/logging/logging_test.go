package logging

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/zap"
)

// The JSON log has an ISO 8601 "ts" and durations with their unit.
func TestJSONShape(t *testing.T) {
	path := filepath.Join(t.TempDir(), "log")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	old := os.Stderr
	os.Stderr = f
	log, err := New("info", "")
	os.Stderr = old
	if err != nil {
		t.Fatal(err)
	}
	log.Info("hello", zap.Duration("ack_wait", 30*time.Second))
	_ = log.Sync()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var e map[string]any
	if err := json.Unmarshal(bytes.TrimSpace(b), &e); err != nil {
		t.Fatalf("%s: %v", b, err)
	}
	if e["ack_wait"] != "30s" {
		t.Errorf("ack_wait = %v, want \"30s\"", e["ack_wait"])
	}
	ts, _ := e["ts"].(string)
	if _, err := time.Parse("2006-01-02T15:04:05.000Z0700", ts); err != nil {
		t.Errorf("ts = %v, want ISO 8601: %v", e["ts"], err)
	}
}

func TestBadInput(t *testing.T) {
	for _, c := range []struct{ level, format string }{{"loud", ""}, {"info", "xml"}} {
		if _, err := New(c.level, c.format); err == nil {
			t.Errorf("New(%q, %q) accepted", c.level, c.format)
		}
	}
}
