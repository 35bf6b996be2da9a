package status

import (
	"encoding/json"
	"net/http"
)

// The probe bodies, as stunnerd v1.2.1 writes them (internal/object/admin.go):
// /live answers {} and /ready {"status":CODE,"message":...}, both as
// "application/json; charset=utf-8". A not-ready answer carries stunnerd's
// message and, beside it, why (a field stunnerd does not have: readers that
// decode stunnerd's two fields still do).

// probeBody is /ready's body.
type probeBody struct {
	Status  int    `json:"status"`
	Message string `json:"message"`
	Reason  string `json:"reason,omitempty"`
}

// notReadyMessage is stunnerd's message for a 503.
const notReadyMessage = "stunnerd not ready"

// WriteLive answers /live.
func WriteLive(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write([]byte("{}\n"))
}

// WriteReady answers /ready: 200 READY when reason is empty, else 503 with
// the reason.
func WriteReady(w http.ResponseWriter, reason string) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	body := probeBody{Status: http.StatusOK, Message: Ready}
	if reason != "" {
		body = probeBody{Status: http.StatusServiceUnavailable, Message: notReadyMessage, Reason: reason}
	}
	w.WriteHeader(body.Status)
	_ = json.NewEncoder(w).Encode(body)
}
