// An order service written in Go, with the statements of the Go + PostgreSQL
// outbox article as its readers run them: it writes each order and its event in
// one transaction with the article's InsertOutboxEvent, with no outbox library.
// The `outbox` binary relays the events to NATS JetStream; the consumer here
// reads them and deduplicates by event id with the inbox table (processed_events).
//
// Built with Debian's Go packages and nothing downloaded (scripts/go.sh):
//
//	GO111MODULE=off GOPATH=/usr/share/gocode go build -o orders main.go
//	orders -schema shop produce -orders 100
//	orders -schema shop consume -stream EVENTS -subject 'outbox.>' -durable billing -expect 200
package main

import (
	"database/sql"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	_ "github.com/lib/pq"
	"github.com/nats-io/nats.go"
)

// InsertOutboxEvent, the article's producer statement, unchanged.
const insertOutboxEvent = `INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES ($1, $2, $3, $4)`

// OutboxPendingCount, the article's pending count, unchanged.
const outboxPendingCount = `SELECT COUNT(*) FROM outbox_events WHERE processed_at IS NULL`

func main() {
	schema := flag.String("schema", "public", "schema of the orders, the outbox and the inbox (search_path)")
	flag.Parse()
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		url = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	db, err := open(url, *schema)
	if err != nil {
		fail("database: %v", err)
	}
	defer db.Close()
	args := flag.Args()
	if len(args) == 0 {
		fail("usage: orders [-schema S] produce|consume [options]")
	}
	switch args[0] {
	case "produce":
		err = produce(db, args[1:])
	case "consume":
		err = consume(db, args[1:])
	default:
		err = fmt.Errorf("unknown command %q (produce, consume)", args[0])
	}
	if err != nil {
		fail("%s: %v", args[0], err)
	}
}

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "orders: "+format+"\n", args...)
	os.Exit(1)
}

// open connects with the schema first on the search path, as a service whose
// tables live in a schema of its own would.
func open(url, schema string) (*sql.DB, error) {
	separator := "?"
	if strings.Contains(url, "?") {
		separator = "&"
	}
	if !strings.Contains(url, "sslmode=") {
		url += separator + "sslmode=disable"
		separator = "&"
	}
	db, err := sql.Open("postgres", url+separator+"search_path="+schema)
	if err != nil {
		return nil, err
	}
	return db, db.Ping()
}

type orderCreated struct {
	OrderID  int64  `json:"order_id"`
	Customer string `json:"customer"`
	Total    int    `json:"total_cents"`
}

type orderPaid struct {
	OrderID int64 `json:"order_id"`
	Total   int   `json:"total_cents"`
}

// produce writes each order with its order.created event in one transaction, then
// pays it with its order.paid event in another: two events per order, in order.
func produce(db *sql.DB, args []string) error {
	flags := flag.NewFlagSet("produce", flag.ExitOnError)
	orders := flags.Int("orders", 10, "orders to write")
	flags.Parse(args)
	if _, err := db.Exec(`CREATE TABLE IF NOT EXISTS orders (
		id bigserial PRIMARY KEY, customer text NOT NULL, total_cents int NOT NULL,
		status text NOT NULL DEFAULT 'created')`); err != nil {
		return err
	}
	for i := 0; i < *orders; i++ {
		customer, total := fmt.Sprintf("customer-%d", i%7), 100+i
		var id int64
		err := inTx(db, func(tx *sql.Tx) error {
			if err := tx.QueryRow(`INSERT INTO orders (customer, total_cents) VALUES ($1, $2) RETURNING id`,
				customer, total).Scan(&id); err != nil {
				return err
			}
			return writeEvent(tx, id, "order.created", orderCreated{id, customer, total})
		})
		if err != nil {
			return err
		}
		err = inTx(db, func(tx *sql.Tx) error {
			if _, err := tx.Exec(`UPDATE orders SET status = 'paid' WHERE id = $1`, id); err != nil {
				return err
			}
			return writeEvent(tx, id, "order.paid", orderPaid{id, total})
		})
		if err != nil {
			return err
		}
	}
	var pending int
	if err := db.QueryRow(outboxPendingCount).Scan(&pending); err != nil {
		return err
	}
	fmt.Printf("produced orders=%d events=%d pending=%d\n", *orders, 2**orders, pending)
	return nil
}

func writeEvent(tx *sql.Tx, orderID int64, eventType string, payload interface{}) error {
	body, err := json.Marshal(payload)
	if err != nil {
		return err
	}
	// The payload goes as text: lib/pq sends a []byte as bytea, which jsonb refuses.
	_, err = tx.Exec(insertOutboxEvent, "order", fmt.Sprint(orderID), eventType, string(body))
	return err
}

func inTx(db *sql.DB, work func(*sql.Tx) error) error {
	tx, err := db.Begin()
	if err != nil {
		return err
	}
	if err := work(tx); err != nil {
		tx.Rollback()
		return err
	}
	return tx.Commit()
}

// consume reads the stream from its start with a durable pull consumer. Each
// message is handled once: its event id (the relay's Nats-Msg-Id header) goes into
// the inbox in the transaction that records the billing line, and a repeat is
// skipped. Stops after `expect` messages (first deliveries and repeats).
func consume(db *sql.DB, args []string) error {
	flags := flag.NewFlagSet("consume", flag.ExitOnError)
	natsURL := flags.String("nats", nats.DefaultURL, "NATS server")
	stream := flags.String("stream", "", "JetStream stream the relay publishes to")
	subject := flags.String("subject", ">", "subjects to read")
	durable := flags.String("durable", "billing", "durable consumer name")
	expect := flags.Int("expect", 0, "messages to read before stopping")
	wait := flags.Duration("timeout", 60*time.Second, "longest wait for them")
	flags.Parse(args)
	if _, err := db.Exec(`CREATE TABLE IF NOT EXISTS billing (
		line bigserial PRIMARY KEY, event_id uuid NOT NULL, order_id text NOT NULL,
		event_type text NOT NULL, payload jsonb NOT NULL)`); err != nil {
		return err
	}
	nc, err := nats.Connect(*natsURL)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := nc.JetStream()
	if err != nil {
		return err
	}
	sub, err := js.PullSubscribe(*subject, *durable, nats.BindStream(*stream), nats.DeliverAll())
	if err != nil {
		return err
	}
	applied, duplicates := 0, 0
	deadline := time.Now().Add(*wait)
	for applied+duplicates < *expect {
		if time.Now().After(deadline) {
			return fmt.Errorf("read %d of %d messages within %v", applied+duplicates, *expect, *wait)
		}
		msgs, err := sub.Fetch(100, nats.MaxWait(time.Second))
		if err != nil && err != nats.ErrTimeout {
			return err
		}
		for _, msg := range msgs {
			first, err := handle(db, msg)
			if err != nil {
				return err
			}
			if first {
				applied++
			} else {
				duplicates++
			}
			if err := msg.Ack(); err != nil {
				return err
			}
		}
	}
	fmt.Printf("consumed applied=%d duplicates=%d\n", applied, duplicates)
	return nil
}

// handle records the event id in the inbox and, the first time only, the billing
// line, in one transaction: a redelivered or republished event changes nothing.
func handle(db *sql.DB, msg *nats.Msg) (bool, error) {
	id := msg.Header.Get("Nats-Msg-Id")
	if id == "" {
		return false, fmt.Errorf("message on %s without an event id", msg.Subject)
	}
	first := false
	err := inTx(db, func(tx *sql.Tx) error {
		result, err := tx.Exec(`INSERT INTO processed_events (consumer, event_id) VALUES ('go-billing', $1)
			ON CONFLICT DO NOTHING`, id)
		if err != nil {
			return err
		}
		rows, err := result.RowsAffected()
		if err != nil || rows == 0 {
			return err
		}
		first = true
		_, err = tx.Exec(`INSERT INTO billing (event_id, order_id, event_type, payload) VALUES ($1, $2, $3, $4)`,
			id, msg.Header.Get("outbox-aggregate-id"), msg.Header.Get("outbox-event-type"), string(msg.Data))
		return err
	})
	return first, err
}
