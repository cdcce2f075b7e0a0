// Package observe holds what the consumer engine (package consumer) and a
// group member (consumer/internal/group) share to be observed: collectors
// registered once per Registerer, and a polling loop's quiet log.
package observe

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// Register registers c, or returns the collector of the same name another
// consumer registered before on reg.
func Register[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	err := reg.Register(c)
	if err == nil {
		return c, nil
	}
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(C); ok {
			return existing, nil
		}
	}
	return c, err
}

// LoopHealth keeps a polling loop's log quiet during an outage: the first
// failure is a warning, repeats are debug messages, recovery is noted once.
type LoopHealth struct{ failures int }

// Report logs the outcome err of one round of the loop doing what.
func (h *LoopHealth) Report(log *zap.Logger, what string, err error) {
	switch {
	case err != nil && h.failures == 0:
		log.Warn(what+" failed; retrying quietly until it succeeds", zap.Error(err))
	case err != nil:
		log.Debug(what+" failed again", zap.Int("failures", h.failures+1), zap.Error(err))
	case h.failures > 0:
		log.Info(what+" works again", zap.Int("failures", h.failures))
	}
	if err != nil {
		h.failures++
	} else {
		h.failures = 0
	}
}
