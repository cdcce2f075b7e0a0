package main

import (
	"fmt"
	"io"
	"strings"
	"sync"
)

// printer writes the demo's output for people. The stream watcher and the
// main flow print concurrently; the mutex keeps each block in one piece.
type printer struct {
	mu       sync.Mutex
	w        io.Writer
	onBroken func() // called when a write fails: nobody reads the output
}

func newPrinter(w io.Writer, onBroken func()) *printer { return &printer{w: w, onBroken: onBroken} }

// step starts a new section of the demo.
func (p *printer) step(format string, args ...any) {
	p.block("==> "+fmt.Sprintf(format, args...), nil)
}

// detail prints an indented line under the current section.
func (p *printer) detail(format string, args ...any) {
	p.block("    "+fmt.Sprintf(format, args...), nil)
}

// block prints a head line and indented body lines as one unit.
func (p *printer) block(head string, body []string) {
	var b strings.Builder
	b.WriteString(head)
	b.WriteByte('\n')
	for _, l := range body {
		b.WriteString("      ")
		b.WriteString(l)
		b.WriteByte('\n')
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, err := io.WriteString(p.w, b.String()); err != nil {
		p.onBroken()
	}
}

// short abbreviates a UUID for prose; full ids appear in the event blocks.
func short(id string) string {
	if len(id) > 8 {
		return id[:8]
	}
	return id
}
