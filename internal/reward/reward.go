// Package reward is the seed lesson's reward scenario as a consumer
// handler: every RegistrationConfirmed event credits points to the
// registration's player through apply_reward_event, in the consumer
// library's transaction. cmd/reward-consumer runs it as a service and
// make demo runs it in-process.
package reward

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/consumer"
)

// EventType is the only event type the reward consumer handles.
const EventType = "RegistrationConfirmed"

// Handler credits a fixed number of points to the player of each
// confirmed registration, through the seed's apply_reward_event.
//
// The mapping is deliberately simple and deterministic: the player is the
// registration's row in reward_registration (sql/reward.sql), and every
// confirmation earns the same number of points.
type Handler struct {
	// Ledger is apply_reward_event's p_consumer: the key of the function's
	// own dedup row. It names the effect (points credited to
	// reward_account), not the consumer, so two deployments sharing the
	// database under different consumer names still credit an event once.
	Ledger string
	// Points credited per confirmed registration.
	Points int32
	// Applied, if set, is called inside the transaction when the points
	// were credited (not for an event the ledger already holds); the
	// transaction may still roll back after it.
	Applied func(m *consumer.Message, registration, player uuid.UUID)
}

// confirmed is the payload of RegistrationConfirmed, as the seed's CTE
// builds it: jsonb_build_object('registrationId', id, 'version', version).
type confirmed struct {
	RegistrationID *string `json:"registrationId"`
	Version        *int64  `json:"version"`
}

// Handle runs in the consumer library's transaction, after the library
// recorded the event in consumed_message under the consumer's name.
func (h *Handler) Handle(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	if m.Type != EventType {
		return nil // not ours (the consumer is configured to skip these anyway)
	}
	reg, err := parseConfirmed(m)
	if err != nil {
		return consumer.Permanent(err)
	}
	eventID, err := uuid.Parse(m.ID)
	if err != nil {
		return consumer.Permanent(fmt.Errorf("event id %q is not a UUID, which apply_reward_event requires", m.ID))
	}
	var player uuid.UUID
	err = tx.QueryRow(ctx, `SELECT player_id FROM reward_registration WHERE registration_id = $1`, reg).Scan(&player)
	if errors.Is(err, pgx.ErrNoRows) {
		return consumer.Permanent(fmt.Errorf("registration %s has no player in reward_registration: insert its player, then replay this dead letter", reg))
	}
	if err != nil {
		return fmt.Errorf("look up the player of registration %s: %w", reg, err)
	}
	var applied bool
	err = tx.QueryRow(ctx, `SELECT apply_reward_event($1, $2, $3, $4)`, h.Ledger, eventID, player, h.Points).Scan(&applied)
	var pgErr *pgconn.PgError
	switch {
	case err == nil:
		// applied == false: the ledger already holds this event (credited
		// under another consumer name); crediting it again is what the
		// function prevents, so this is success without an effect.
		if applied && h.Applied != nil {
			h.Applied(m, reg, player)
		}
		return nil
	case errors.As(err, &pgErr) && pgErr.Code == pgerrcode.RaiseException:
		// The function's own checks: a missing reward account, or a
		// non-positive delta. Redelivery cannot fix either; opening the
		// account and replaying the dead letter can.
		return consumer.Permanent(fmt.Errorf("apply_reward_event for player %s: %s", player, pgErr.Message))
	case errors.As(err, &pgErr) && pgErr.Code == pgerrcode.NumericValueOutOfRange:
		return consumer.Permanent(fmt.Errorf("player %s: points would overflow: %s", player, pgErr.Message))
	default:
		return fmt.Errorf("apply_reward_event: %w", err)
	}
}

// parseConfirmed checks the payload against the event's headers and returns
// the registration id.
func parseConfirmed(m *consumer.Message) (uuid.UUID, error) {
	var p confirmed
	if err := json.Unmarshal(m.Payload, &p); err != nil {
		return uuid.Nil, fmt.Errorf("payload is not a %s object: %w", EventType, err)
	}
	switch {
	case p.RegistrationID == nil:
		return uuid.Nil, fmt.Errorf("payload lacks registrationId")
	case p.Version == nil:
		return uuid.Nil, fmt.Errorf("payload lacks version")
	}
	reg, err := uuid.Parse(*p.RegistrationID)
	if err != nil {
		return uuid.Nil, fmt.Errorf("payload registrationId %q is not a UUID", *p.RegistrationID)
	}
	if agg, err := uuid.Parse(m.AggregateID); err != nil || agg != reg {
		return uuid.Nil, fmt.Errorf("payload registrationId %s does not match the event's aggregate id %q", reg, m.AggregateID)
	}
	if *p.Version != m.AggregateVersion {
		return uuid.Nil, fmt.Errorf("payload version %d does not match the event's aggregate version %d", *p.Version, m.AggregateVersion)
	}
	return reg, nil
}
