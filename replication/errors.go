package replication

import (
	"errors"
	"fmt"
)

// Errors that need an operator: each one stops the relay with a message that
// says what to fix. Callers branch on them with errors.Is.
var (
	// ErrWalLevel means the server's wal_level is not logical.
	ErrWalLevel = errors.New("wal_level is not logical")
	// ErrNoReplicationRole means the role lacks the REPLICATION attribute.
	ErrNoReplicationRole = errors.New("role lacks the REPLICATION attribute")
	// ErrSlotInUse means another process streams from the slot. With
	// several relay instances this is the normal state of the standbys.
	ErrSlotInUse = errors.New("replication slot is in use by another process")
	// ErrSlotLost means the slot's WAL was removed before the relay read it
	// (wal_status = 'lost'): events committed in that WAL were never relayed.
	ErrSlotLost = errors.New("replication slot was invalidated: events were lost")
	// ErrSlotMissing means the slot does not exist and the relay was told
	// not to create it.
	ErrSlotMissing = errors.New("replication slot does not exist")
	// ErrSlotMismatch means a slot of that name exists but belongs to
	// another database or output plugin.
	ErrSlotMismatch = errors.New("replication slot belongs to another database or plugin")
	// ErrPublicationMissing means the publication does not exist and the
	// relay was told not to create it.
	ErrPublicationMissing = errors.New("publication does not exist")
	// ErrPublicationMismatch means the publication does not carry the
	// outbox as the relay needs: a table missing, updates or deletes
	// published, a partitioned table not published through its root, a row
	// filter.
	ErrPublicationMismatch = errors.New("publication does not publish the outbox as the relay needs")
	// ErrTableMissing means a configured outbox table does not exist.
	ErrTableMissing = errors.New("outbox table does not exist")
	// ErrServerSilent means nothing arrived from the server within the
	// receive timeout; the relay reconnects.
	ErrServerSilent = errors.New("replication connection silent")
	// ErrFailoverUnsupported means failover slots were requested from a
	// server older than PostgreSQL 17.
	ErrFailoverUnsupported = errors.New("failover slots need PostgreSQL 17 or later")
	// ErrBackfillIncomplete means a backfill from the slot's snapshot was
	// interrupted: rows of the snapshot may never have been published, and
	// streaming from the slot would skip them for good.
	ErrBackfillIncomplete = errors.New("the backfill of the slot's snapshot did not finish")
	// ErrBackfillInProgress means another process is backfilling from the
	// slot's snapshot; streaming now would overtake it. Like ErrSlotInUse,
	// it is a standby's state: wait and retry.
	ErrBackfillInProgress = errors.New("another process is backfilling the slot")
	// ErrProtocol reports a replication message the relay cannot decode or
	// that breaks the protocol's rules; it is not retryable by reconnecting.
	ErrProtocol = errors.New("replication protocol error")
)

// ErrInvalidOption is wrapped by the error Open returns for a bad Option.
var ErrInvalidOption = errors.New("invalid replication option")

// Errors about the server's version, role and failover readiness.
var (
	// ErrVersionUnsupported means a configured feature needs a newer
	// PostgreSQL than the server's.
	ErrVersionUnsupported = errors.New("feature needs a newer PostgreSQL")
	// ErrStandbyDecoding means the relay was pointed at a standby that
	// cannot decode for it: PostgreSQL before 16, or hot_standby_feedback off.
	ErrStandbyDecoding = errors.New("logical decoding on this standby is not possible")
	// ErrNoPrimary means no host of postgres.url accepted a read-write
	// session (target_session_attrs): all that answered are standbys. It is
	// retried, since a promotion may be under way.
	ErrNoPrimary = errors.New("no PostgreSQL primary reachable")
)

// ActionableError adds an operator hint to one of the sentinel errors above.
type ActionableError struct {
	Err    error  // one of the sentinels
	Detail string // what was observed
	Hint   string // what to do
}

func (e *ActionableError) Error() string {
	s := e.Err.Error()
	if e.Detail != "" {
		s += ": " + e.Detail
	}
	if e.Hint != "" {
		s += " (" + e.Hint + ")"
	}
	return s
}

// Unwrap returns the sentinel.
func (e *ActionableError) Unwrap() error { return e.Err }

func actionable(err error, hint string, detailFormat string, args ...any) error {
	return &ActionableError{Err: err, Detail: fmt.Sprintf(detailFormat, args...), Hint: hint}
}

// IsPermanent reports whether err needs an operator rather than a
// reconnect: bad settings, a lost or foreign slot, an undecodable stream.
func IsPermanent(err error) bool {
	for _, p := range []error{ErrWalLevel, ErrNoReplicationRole, ErrSlotLost, ErrSlotMissing, ErrSlotMismatch, ErrPublicationMissing, ErrPublicationMismatch, ErrTableMissing, ErrProtocol, ErrFailoverUnsupported,
		ErrVersionUnsupported, ErrStandbyDecoding, ErrBackfillIncomplete} {
		if errors.Is(err, p) {
			return true
		}
	}
	return false
}
