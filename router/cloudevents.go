package router

import (
	"net/url"
	"strings"
)

// CloudEventsConfig turns on CloudEvents binary content mode for a table's
// (or message prefix's) events: the router sets ce-specversion, ce-id,
// ce-source, ce-type, ce-subject, ce-time (when the row has occurred_at),
// the extensions ce-aggregateversion and ce-aggregatetype and content-type beside the Outbox-* headers, which stay, so existing
// consumers keep working. Nats-Msg-Id stays the event id.
type CloudEventsConfig struct {
	// Enabled adds the ce-* headers.
	Enabled bool `yaml:"enabled"`
	// Source is the ce-source attribute, a URI reference. Default
	// DefaultCloudEventsSourcePrefix + "<schema.table>" (for a message
	// prefix, <schema.table> is pg_logical_message.<prefix>): the router
	// does not know the database's name, so name it here when several
	// databases relay into one stream, e.g. /outbox-relay/shop/public.outbox.
	Source string `yaml:"source"`
}

// DefaultCloudEventsSourcePrefix starts the default ce-source.
const DefaultCloudEventsSourcePrefix = "/outbox-relay/"

// ceHeaders are the headers CloudEvents mode adds (cloudEventsHeaders);
// an extra column of such a table must not be mapped to one.
var ceHeaders = cloudEventsHeaders.names()

// checkCloudEventsSource reports why s cannot be a ce-source value.
func checkCloudEventsSource(s string) string {
	if msg := checkHeaderValue(s); msg != "" {
		return msg
	}
	if _, err := url.Parse(s); err != nil {
		return "is not a URI reference: " + err.Error()
	}
	return ""
}

// isCEHeader reports whether h is one of ceHeaders, compared
// case-insensitively like the contract headers.
func isCEHeader(h string) bool {
	for _, c := range ceHeaders {
		if strings.EqualFold(h, c) {
			return true
		}
	}
	return false
}
