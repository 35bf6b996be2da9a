package listener

import (
	"net"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/quota"
)

// quotaHandler is pion's QuotaHandler for one of its servers: while draining
// and over a quota, new allocations get 486 (Allocation Quota Reached);
// existing ones keep refreshing and relaying.
func (s *Set) quotaHandler(qs quota.Server) turn.QuotaHandler {
	return func(username, _ string, src net.Addr) bool {
		reason := quota.Draining
		if !s.deps.Draining() {
			reason = s.deps.Quota.Reserve(qs, src, s.deps.Credentials.UserID(username))
		} else {
			s.deps.Quota.Refuse(reason)
		}
		if reason == quota.Granted {
			return true
		}
		// A credential holder can ask again and again: rate-limited.
		s.strangerLog.Info("allocation refused", "reason", reason.String(), "user", username, "client", src.String())
		return false
	}
}

// limitPermissions is the permission handler h of server qs with the
// per-allocation permission limit after it.
func (s *Set) limitPermissions(qs quota.Server, h turn.PermissionHandler) turn.PermissionHandler {
	return func(client net.Addr, peer net.IP) bool {
		if !h(client, peer) {
			return false
		}
		if s.deps.Permissions.Allow(qs, client, peer) {
			return true
		}
		s.strangerLog.Info("permission refused", "client", client.String(), "peer", peer.String(), "reason", "permission quota of the allocation")
		return false
	}
}

// quotaHooks tell the quota counter the outcome of what quotaHandler granted
// on server qs, and when the allocations end; and the permission limit the
// permissions installed and gone.
func (s *Set) quotaHooks(qs quota.Server) stage {
	q, perms, creds := s.deps.Quota, s.deps.Permissions, s.deps.Credentials
	return func(h turn.EventHandler) turn.EventHandler {
		permCreated, permDeleted := h.OnPermissionCreated, h.OnPermissionDeleted
		h.OnPermissionCreated = func(src, dst net.Addr, proto, user, realm string, relay net.Addr, peer net.IP) {
			perms.Created(qs, src, peer)
			if permCreated != nil {
				permCreated(src, dst, proto, user, realm, relay, peer)
			}
		}
		h.OnPermissionDeleted = func(src, dst net.Addr, proto, user, realm string, relay net.Addr, peer net.IP) {
			perms.Deleted(qs, src, peer)
			if permDeleted != nil {
				permDeleted(src, dst, proto, user, realm, relay, peer)
			}
		}
		created, deleted, failed := h.OnAllocationCreated, h.OnAllocationDeleted, h.OnAllocationError
		h.OnAllocationCreated = func(src, dst net.Addr, proto, user, realm string, relay net.Addr, port int) {
			q.Created(qs, src, creds.UserID(user))
			if created != nil {
				created(src, dst, proto, user, realm, relay, port)
			}
		}
		h.OnAllocationDeleted = func(src, dst net.Addr, proto, user, realm string) {
			q.Deleted(qs, src)
			// Permissions it held whose hooks replacements dropped go with it.
			perms.Forget(qs, src)
			if deleted != nil {
				deleted(src, dst, proto, user, realm)
			}
		}
		h.OnAllocationError = func(src, dst net.Addr, proto, msg string) {
			q.Failed(qs, src)
			if failed != nil {
				failed(src, dst, proto, msg)
			}
		}
		return h
	}
}
