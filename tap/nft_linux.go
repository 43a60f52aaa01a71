package tap

import (
	"encoding/binary"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// nf_tables message building. Integers in nf_tables attributes are big
// endian; every message body starts with struct nfgenmsg.

// nfBrPreRouting is NF_BR_PRE_ROUTING (linux/netfilter_bridge.h), and
// nfBrPriFilter the priority of the bridge filter hook
// (NF_BR_PRI_FILTER_BRIDGED), where `nft` puts "priority filter".
const (
	nfBrPreRouting = 0
	nfBrPriFilter  = -200
)

// Netfilter verdicts (linux/netfilter.h) and the nf_tables return verdict.
const (
	nfDrop    int32 = 0 // NF_DROP
	nfAccept  int32 = 1 // NF_ACCEPT
	nftReturn int32 = unix.NFT_RETURN
)

// nfgenmsg encodes struct nfgenmsg: family, version, resource id (big
// endian).
func nfgenmsg(family uint8, resID uint16) []byte {
	b := []byte{family, unix.NFNETLINK_V0, 0, 0}
	binary.BigEndian.PutUint16(b[2:4], resID)
	return b
}

// nftMessage builds one nf_tables request of type typ (NFT_MSG_*).
func nftMessage(typ int, flags netlink.HeaderFlags, family uint8, attrs func(ae *netlink.AttributeEncoder)) (netlink.Message, error) {
	ae := netlink.NewAttributeEncoder()
	ae.ByteOrder = binary.BigEndian
	attrs(ae)
	b, err := ae.Encode()
	if err != nil {
		return netlink.Message{}, err
	}
	return netlink.Message{
		Header: netlink.Header{
			Type:  netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | typ),
			Flags: netlink.Request | flags,
		},
		Data: append(nfgenmsg(family, 0), b...),
	}, nil
}

// batch wraps msgs in NFNL_MSG_BATCH_BEGIN/END, so the kernel applies them
// as one transaction: all or nothing.
func batch(msgs []netlink.Message) []netlink.Message {
	mark := func(typ int) netlink.Message {
		return netlink.Message{
			Header: netlink.Header{Type: netlink.HeaderType(typ), Flags: netlink.Request},
			Data:   nfgenmsg(unix.AF_UNSPEC, unix.NFNL_SUBSYS_NFTABLES),
		}
	}
	out := make([]netlink.Message, 0, len(msgs)+2)
	out = append(out, mark(unix.NFNL_MSG_BATCH_BEGIN))
	out = append(out, msgs...)
	return append(out, mark(unix.NFNL_MSG_BATCH_END))
}

// An expr encodes one nf_tables expression (an NFTA_LIST_ELEM).
type expr func(ae *netlink.AttributeEncoder)

func exprElem(name string, data func(ae *netlink.AttributeEncoder)) expr {
	return func(ae *netlink.AttributeEncoder) {
		ae.Nested(unix.NFTA_LIST_ELEM, func(le *netlink.AttributeEncoder) error {
			le.String(unix.NFTA_EXPR_NAME, name)
			le.Nested(unix.NFTA_EXPR_DATA, func(d *netlink.AttributeEncoder) error {
				data(d)
				return nil
			})
			return nil
		})
	}
}

// All loads and compares use register 1 (NFT_REG_1, 16 bytes).
const reg1 = unix.NFT_REG_1

// metaLoad loads a meta key (NFT_META_*) into register 1.
func metaLoad(key uint32) expr {
	return exprElem("meta", func(ae *netlink.AttributeEncoder) {
		ae.Uint32(unix.NFTA_META_DREG, reg1)
		ae.Uint32(unix.NFTA_META_KEY, key)
	})
}

// payloadLoad loads length bytes at offset from a header base
// (NFT_PAYLOAD_*_HEADER) into register 1.
func payloadLoad(base, offset, length uint32) expr {
	return exprElem("payload", func(ae *netlink.AttributeEncoder) {
		ae.Uint32(unix.NFTA_PAYLOAD_DREG, reg1)
		ae.Uint32(unix.NFTA_PAYLOAD_BASE, base)
		ae.Uint32(unix.NFTA_PAYLOAD_OFFSET, offset)
		ae.Uint32(unix.NFTA_PAYLOAD_LEN, length)
	})
}

// cmp compares register 1 with data (NFT_CMP_EQ or NFT_CMP_NEQ); the rule
// stops when the comparison fails.
func cmp(op uint32, data []byte) expr {
	return exprElem("cmp", func(ae *netlink.AttributeEncoder) {
		ae.Uint32(unix.NFTA_CMP_SREG, reg1)
		ae.Uint32(unix.NFTA_CMP_OP, op)
		ae.Nested(unix.NFTA_CMP_DATA, func(d *netlink.AttributeEncoder) error {
			d.Bytes(unix.NFTA_DATA_VALUE, data)
			return nil
		})
	})
}

// mask ands register 1 with m (a bitwise expression with a zero xor).
func mask(m []byte) expr {
	return exprElem("bitwise", func(ae *netlink.AttributeEncoder) {
		ae.Uint32(unix.NFTA_BITWISE_SREG, reg1)
		ae.Uint32(unix.NFTA_BITWISE_DREG, reg1)
		ae.Uint32(unix.NFTA_BITWISE_LEN, uint32(len(m)))
		ae.Nested(unix.NFTA_BITWISE_MASK, func(d *netlink.AttributeEncoder) error {
			d.Bytes(unix.NFTA_DATA_VALUE, m)
			return nil
		})
		ae.Nested(unix.NFTA_BITWISE_XOR, func(d *netlink.AttributeEncoder) error {
			d.Bytes(unix.NFTA_DATA_VALUE, make([]byte, len(m)))
			return nil
		})
	})
}

// verdict ends the rule with a verdict code (NF_ACCEPT, NF_DROP,
// NFT_RETURN).
func verdict(code int32) expr {
	return exprElem("immediate", func(ae *netlink.AttributeEncoder) {
		ae.Uint32(unix.NFTA_IMMEDIATE_DREG, unix.NFT_REG_VERDICT)
		ae.Nested(unix.NFTA_IMMEDIATE_DATA, func(d *netlink.AttributeEncoder) error {
			d.Nested(unix.NFTA_DATA_VERDICT, func(v *netlink.AttributeEncoder) error {
				v.Int32(unix.NFTA_VERDICT_CODE, code)
				return nil
			})
			return nil
		})
	})
}

func newTableMsg(family uint8, table string) (netlink.Message, error) {
	return nftMessage(unix.NFT_MSG_NEWTABLE, netlink.Create, family, func(ae *netlink.AttributeEncoder) {
		ae.String(unix.NFTA_TABLE_NAME, table)
	})
}

// newBaseChainMsg creates (or keeps) a filter chain on a hook with policy
// accept.
func newBaseChainMsg(family uint8, table, chain string, hook uint32, priority int32) (netlink.Message, error) {
	return nftMessage(unix.NFT_MSG_NEWCHAIN, netlink.Create, family, func(ae *netlink.AttributeEncoder) {
		ae.String(unix.NFTA_CHAIN_TABLE, table)
		ae.String(unix.NFTA_CHAIN_NAME, chain)
		ae.Nested(unix.NFTA_CHAIN_HOOK, func(h *netlink.AttributeEncoder) error {
			h.Uint32(unix.NFTA_HOOK_HOOKNUM, hook)
			h.Int32(unix.NFTA_HOOK_PRIORITY, priority)
			return nil
		})
		ae.Uint32(unix.NFTA_CHAIN_POLICY, uint32(nfAccept))
		ae.String(unix.NFTA_CHAIN_TYPE, "filter")
	})
}

// flushChainMsg deletes every rule of a chain (NFT_MSG_DELRULE without a
// handle).
func flushChainMsg(family uint8, table, chain string) (netlink.Message, error) {
	return nftMessage(unix.NFT_MSG_DELRULE, 0, family, func(ae *netlink.AttributeEncoder) {
		ae.String(unix.NFTA_RULE_TABLE, table)
		ae.String(unix.NFTA_RULE_CHAIN, chain)
	})
}

// getChainMsg asks for one chain; the kernel answers ENOENT when it or its
// table is missing.
func getChainMsg(family uint8, table, chain string) (netlink.Message, error) {
	return nftMessage(unix.NFT_MSG_GETCHAIN, 0, family, func(ae *netlink.AttributeEncoder) {
		ae.String(unix.NFTA_CHAIN_TABLE, table)
		ae.String(unix.NFTA_CHAIN_NAME, chain)
	})
}

// delChainMsg deletes a chain together with its rules.
func delChainMsg(family uint8, table, chain string) (netlink.Message, error) {
	return nftMessage(unix.NFT_MSG_DELCHAIN, 0, family, func(ae *netlink.AttributeEncoder) {
		ae.String(unix.NFTA_CHAIN_TABLE, table)
		ae.String(unix.NFTA_CHAIN_NAME, chain)
	})
}

// newRuleMsg appends a rule made of exprs to a chain.
func newRuleMsg(family uint8, table, chain string, exprs []expr) (netlink.Message, error) {
	return nftMessage(unix.NFT_MSG_NEWRULE, netlink.Create|netlink.Append, family, func(ae *netlink.AttributeEncoder) {
		ae.String(unix.NFTA_RULE_TABLE, table)
		ae.String(unix.NFTA_RULE_CHAIN, chain)
		ae.Nested(unix.NFTA_RULE_EXPRESSIONS, func(le *netlink.AttributeEncoder) error {
			for _, e := range exprs {
				e(le)
			}
			return nil
		})
	})
}
